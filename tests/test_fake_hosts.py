"""sglang's spawn path on GPU hosts this machine is not, each a fake sysfs tree mounted
in a private mount namespace with a stand-in NVML (tests/fakehost.py).

Every rank is spawned as sglang's Engine and data-parallel controller spawn it, inside
``numa_utils.configure_subprocess(server_args, gpu_id)`` in an engine's launching
process on the fake host (tests/harness/rank_probe.py), and reads back the binding
the kernel gave it. Where ``configure_scheduler_process`` could still move a rank
(SGLANG_SET_CPU_AFFINITY, the V1 bind), the rank runs sglang's own
``run_scheduler_process`` with only its Scheduler replaced, and reports after it.

The kernel still binds only this machine's CPUs and memory: each fake node holds one of
this machine's CPUs (``REAL``) and one it lacks, so a rank placed on node N runs on
``NODE_CPU[N]``. This kernel has memory on node 0 only, so a rank of node 1 gets no
memory policy (numactl's ladder ends at its CPUs); the VM tests (tests/test_vm.py)
cover memory.
"""

from __future__ import annotations

import os
import re
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fakehost
import fakesys
import pytest

REAL = sorted(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(
    len(REAL) < 2, reason="the fake hosts put this machine's CPUs 0 and 1 on two nodes"
)


def _cpus_this_host_lacks(count: int) -> list[int]:
    with open("/sys/devices/system/cpu/possible") as f:
        last = max(int(part.split("-")[-1]) for part in f.read().strip().split(","))
    return list(range(last + 1, last + 1 + count))


LACKING = _cpus_this_host_lacks(2)
GPU = [fakesys.gpu_address(i) for i in range(4)]
GPU_NODE = {0: 0, 1: 0, 2: 1, 3: 1}
NODE_CPU = {0: [REAL[0]], 1: [REAL[1]]}
UNBOUND = REAL  # the launching process's CPUs (it is not bound)


def two_nodes(*extra, gpu_missing: tuple[str, ...] = ()) -> fakesys.Host:
    """Nodes 0 and 1, each one of this machine's CPUs and one it lacks; GPUs 0 and 1 on
    node 0, 2 and 3 on node 1 (``gpu_missing``: files GPU 1's device lacks)."""
    return fakesys.Host(
        nodes={
            0: fakesys.NodeSpec(cpus=[REAL[0], LACKING[0]]),
            1: fakesys.NodeSpec(cpus=[REAL[1], LACKING[1]]),
        },
        pci=[fakesys.host_bridge(0)]
        + [
            fakesys.PciSpec(gpu, GPU_NODE[i], missing=gpu_missing if i == 1 else ())
            for i, gpu in enumerate(GPU)
        ]
        + list(extra),
    )


def cuda(**fields) -> dict:
    return {"device": "cuda", **fields}


def explain(result: dict) -> str:
    """What the launching process logged: each rank's placement and every warning."""
    lines = result.get("info", []) + result.get("warnings", [])
    return "\n".join([f"scenario {result['name']!r}:", *lines])


def by_gpu(result: dict) -> dict[int, dict]:
    assert "error" not in result, result
    return {row["gpu_id"]: row for row in result["ranks"]}


def cpus_of(row: dict, result: dict) -> list[int]:
    """The rank's CPUs, the same for every one of its threads."""
    report = row.get("report")
    assert "error" not in row, f"GPU {row['gpu_id']}: {row['error']}\n{explain(result)}"
    assert row.get("exitcode") == 0 and report, (row, result["stderr"])
    assert report["thread_cpus"] == [report["cpus"]], report
    return report["cpus"]


def assert_on(result: dict, expected: dict[int, list[int]]) -> None:
    """Each rank (by gpu_id) ran on ``expected``'s CPUs."""
    ranks = by_gpu(result)
    seen = {gpu: cpus_of(ranks[gpu], result) for gpu in expected}
    assert seen == expected, f"CPUs by GPU {seen}\n{explain(result)}"


def warnings_naming(result: dict, pattern: str) -> list[str]:
    return [w for w in result["warnings"] if re.search(pattern, w)]


@pytest.fixture(scope="module")
def two_node_schedulers():
    """Scheduler ranks (sglang's run_scheduler_process) on the two-node, four-GPU host,
    in one launching process."""
    fakehost.require_root()
    scenarios = [
        # sglang's gpu_id arithmetic: dp rank d starts at GPU 2d; each dp rank's
        # thread spawns at once. Upstream's SGLANG_SET_CPU_AFFINITY slice, which
        # configure_scheduler_process applies, moved GPU 2's rank to node 0.
        dict(
            name="dp2 tp2, SGLANG_SET_CPU_AFFINITY=1",
            engine=cuda(tp_size=2, dp_size=2),
            threads=True,
            env={"SGLANG_SET_CPU_AFFINITY": "1"},
        ),
        dict(
            name="V1",
            engine=cuda(tp_size=1, base_gpu_id=1),
            env={"SGLANG_NUMA_BIND_V2": "0"},
        ),
    ]
    for scenario in scenarios:
        scenario["rank"] = "scheduler"
    # Each scheduler rank imports sglang's scheduler module (about 18 s of CPU here).
    job = {"scenarios": scenarios, "timeout": 900}
    results = fakehost.launch(two_nodes(), job, env=fakehost.gpu_env(GPU), timeout=1800)
    return {result["name"]: result for result in results}


@pytest.fixture(scope="module")
def two_node_host():
    """Ranks decided at the spawn (they report at once) on the two-node, four-GPU
    host, in one launching process."""
    fakehost.require_root()
    with tempfile.TemporaryDirectory(prefix="fake-hosts-") as tmp:
        no_numactl = fakehost.path_without_numactl(Path(tmp) / "bin")
        in_container = {"FAKE_NVML_GPUS": f"{GPU[1]},{GPU[2]}"}
        omp = {"SGLANG_CPU_OMP_THREADS_BIND": f"{REAL[1]}|{REAL[0]}"}
        scenarios = [
            dict(
                name="--numa-node 1 1 0 0",
                engine=cuda(tp_size=4, numa_node=[1, 1, 0, 0]),
            ),
            dict(name="--numa-node 0 7", engine=cuda(tp_size=2, numa_node=[0, 7])),
            dict(name="--numa-node 0", engine=cuda(tp_size=2, numa_node=[0])),
            dict(name="container", engine=cuda(tp_size=2), env=in_container),
            dict(
                name="container, CUDA_VISIBLE_DEVICES=1,0",
                engine=cuda(tp_size=2),
                env={**in_container, "CUDA_VISIBLE_DEVICES": "1,0"},
            ),
            dict(
                name="no numactl",
                engine=cuda(tp_size=4),
                gpu_ids=[2],
                env={"PATH": no_numactl},
            ),
            dict(
                name="no numactl, crash",
                engine=cuda(tp_size=4),
                gpu_ids=[2],
                env={"PATH": no_numactl, "SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "1"},
            ),
            dict(name="CPU engine", engine={"device": "cpu", "tp_size": 2}, env=omp),
        ]
        results = fakehost.launch(
            two_nodes(), {"scenarios": scenarios}, env=fakehost.gpu_env(GPU)
        )
    return {result["name"]: result for result in results}


def test_dp_ranks_end_on_their_gpus_node_after_sglangs_setup(two_node_schedulers):
    """dp2 x tp2 through sglang's run_scheduler_process: each rank on its GPU's node once
    configure_scheduler_process has run, SGLANG_SET_CPU_AFFINITY=1 included (upstream's
    NUMA-blind slice put GPU 2's rank on node 0)."""
    result = two_node_schedulers["dp2 tp2, SGLANG_SET_CPU_AFFINITY=1"]
    ranks = by_gpu(result)
    assert sorted(ranks) == [0, 1, 2, 3]
    assert [ranks[g]["dp_rank"] for g in range(4)] == [0, 0, 1, 1]
    for gpu, row in ranks.items():
        assert cpus_of(row, result) == NODE_CPU[GPU_NODE[gpu]], (gpu, row)
        assert row["report"]["title"].startswith("sglang::scheduler_DP"), row
    for gpu in (0, 1):  # this kernel's node 0 has memory: bound there
        report = ranks[gpu]["report"]
        assert (report["policy"], report["policy_nodes"]) == ("bind", [0]), report


def test_v1_binds_each_rank_in_configure_scheduler_process(two_node_schedulers):
    """SGLANG_NUMA_BIND_V2=0: the rank binds itself (every thread) in sglang's set-up."""
    result = two_node_schedulers["V1"]
    ranks = by_gpu(result)
    assert sorted(ranks) == [1]  # --base-gpu-id 1
    assert cpus_of(ranks[1], result) == NODE_CPU[GPU_NODE[1]], ranks
    assert ranks[1]["report"]["title"].startswith("sglang::scheduler"), ranks
    report = ranks[1]["report"]
    assert (report["policy"], report["policy_nodes"]) == ("preferred", [0]), report


def test_numa_node_list_places_each_gpu_id(two_node_host):
    result = two_node_host["--numa-node 1 1 0 0"]
    assert_on(result, {0: NODE_CPU[1], 1: NODE_CPU[1], 2: NODE_CPU[0], 3: NODE_CPU[0]})


@pytest.mark.parametrize(
    "scenario, named",
    [("--numa-node 0 7", "7"), ("--numa-node 0", "no entry for GPU 1")],
    ids=["a node the host lacks", "no entry for the GPU"],
)
def test_a_bad_numa_node_list_is_an_error_before_the_rank_starts(
    two_node_host, scenario, named
):
    """Regression (3113a40 started GPU 1's rank unbound on a node the host lacks, with
    a warning)."""
    result = two_node_host[scenario]
    assert_on(result, {0: NODE_CPU[0]})
    ranks = by_gpu(result)
    assert not ranks[1]["started"], f"{ranks[1]}\n{explain(result)}"
    assert "--numa-node" in ranks[1].get("error", ""), ranks[1]
    assert named in ranks[1]["error"], ranks[1]


@pytest.mark.parametrize(
    "setting, nodes",
    [("container", [0, 1]), ("container, CUDA_VISIBLE_DEVICES=1,0", [1, 0])],
)
def test_container_given_some_gpus_places_each_rank_by_its_own_gpu(
    two_node_host, setting, nodes
):
    """NVML lists the container's GPUs, the host's 1 (node 0) and 2 (node 1), from 0;
    sysfs lists all four. A rank goes by its own GPU's node, never by sysfs's order."""
    assert_on(two_node_host[setting], {0: NODE_CPU[nodes[0]], 1: NODE_CPU[nodes[1]]})


def test_missing_numactl_leaves_a_gpu_rank_unbound_with_one_warning(two_node_host):
    result = two_node_host["no numactl"]
    row = by_gpu(result)[2]
    assert cpus_of(row, result) == UNBOUND, explain(result)
    named = warnings_naming(result, r"\bGPU 2\b")
    assert len(named) == 1 and "numactl" in named[0], explain(result)


def test_missing_numactl_is_an_error_under_crash_on_bind_failure(two_node_host):
    row = by_gpu(two_node_host["no numactl, crash"])[2]
    assert not row["started"] and "numactl" in row.get("error", ""), row


def test_a_cpu_engine_on_a_gpu_host_is_placed_by_its_cpu_groups(two_node_host):
    """--device cpu on a host with GPUs: each rank gets its SGLANG_CPU_OMP_THREADS_BIND
    group (rank 0 the CPU of node 1, rank 1 that of node 0), not the node of the GPU
    that shares its index."""
    assert_on(two_node_host["CPU engine"], {0: NODE_CPU[1], 1: NODE_CPU[0]})


def one_node_of_cpus() -> tuple:
    """A host whose node 0 holds both of this machine's CPUs and GPUs 0 and 1 (node 1:
    GPUs 2 and 3, CPUs it lacks); SGLANG_SET_CPU_AFFINITY=1."""
    host = fakesys.Host(
        nodes={0: fakesys.NodeSpec(cpus=REAL[:2]), 1: fakesys.NodeSpec(cpus=LACKING)},
        pci=[fakesys.host_bridge(0)]
        + [fakesys.PciSpec(gpu, GPU_NODE[i]) for i, gpu in enumerate(GPU)],
    )
    slices = {"SGLANG_SET_CPU_AFFINITY": "1"}
    job = {
        "scenarios": [
            dict(name="slices", engine=cuda(tp_size=4), gpu_ids=[0, 1], env=slices),
            dict(
                name="slices, one visible GPU per process",
                engine=cuda(tp_size=4),
                gpu_ids=[0, 1],
                env=slices,
                one_visible_device=True,
            ),
        ]
    }
    return host, job, fakehost.gpu_env(GPU, CUDA_DEVICE_ORDER="PCI_BUS_ID")


def sparse_nodes() -> tuple:
    """Nodes 0 and 2, a GPU on each."""
    host = fakesys.Host(
        nodes={
            0: fakesys.NodeSpec(cpus=[REAL[0], LACKING[0]]),
            2: fakesys.NodeSpec(cpus=[REAL[1], LACKING[1]]),
        },
        pci=[
            fakesys.host_bridge(0),
            fakesys.PciSpec(GPU[0], 0),
            fakesys.PciSpec(GPU[1], 2),
        ],
    )
    job = {"scenarios": [dict(name="sparse", engine=cuda(tp_size=2))]}
    return host, job, fakehost.gpu_env(GPU[:2])


ODD_DEVICE = "0000:5e:00.0"
ODD = {
    "without a class file": fakesys.PciSpec(
        ODD_DEVICE, 0, vendor="0x8086", missing={"class"}
    ),
    "vanished": fakesys.PciSpec(ODD_DEVICE, 1, vanished=True),
}


def odd_device(name: str) -> tuple:
    """The two-node host with one more PCI device, not a GPU, that is odd."""
    job = {"scenarios": [dict(name="odd", engine=cuda(tp_size=4))]}
    return two_nodes(ODD[name]), job, fakehost.gpu_env(GPU)


def unreadable_numa_node() -> tuple:
    """NVML fails; GPU 1's device has no numa_node file."""
    crash = {"SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "1"}
    job = {
        "scenarios": [
            dict(name="warn", engine=cuda(tp_size=2)),
            dict(name="crash", engine=cuda(tp_size=2), gpu_ids=[1], env=crash),
        ]
    }
    env = fakehost.gpu_env(GPU, FAKE_NVML_ERROR="Driver/library version mismatch")
    return two_nodes(gpu_missing=("numa_node",)), job, env


@pytest.fixture(scope="module")
def small_hosts() -> dict:
    """Each small host's launch (one launching process each), two at a time: each is
    mostly one process's imports."""
    fakehost.require_root()
    hosts = {
        "one node of CPUs": one_node_of_cpus(),
        "sparse": sparse_nodes(),
        **{f"odd: {name}": odd_device(name) for name in ODD},
        "unreadable numa_node": unreadable_numa_node(),
    }
    with ThreadPoolExecutor(2) as pool:
        futures = {
            name: pool.submit(fakehost.launch, host, job, env=env)
            for name, (host, job, env) in hosts.items()
        }
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("setting", ["slices", "slices, one visible GPU per process"])
def test_set_cpu_affinity_slices_a_node_among_its_gpus(small_hosts, setting):
    """GPUs 0 and 1, node 0's GPUs, get one of its CPUs each; also where each spawn
    sees only its own GPU, as GPU 0 (SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS=1)."""
    results = {r["name"]: r for r in small_hosts["one node of CPUs"]}
    assert_on(results[setting], {0: [REAL[0]], 1: [REAL[1]]})


def test_sparse_node_ids_are_placed(small_hosts):
    """Regression (3113a40: every rank unbound, "this host has one NUMA node")."""
    (result,) = small_hosts["sparse"]
    assert_on(result, {0: [REAL[0]], 1: [REAL[1]]})


@pytest.mark.parametrize("odd", list(ODD))
def test_a_pci_oddity_elsewhere_on_the_bus_leaves_placement_alone(small_hosts, odd):
    """Regression (3113a40 raised PlacementError from configure_subprocess)."""
    (result,) = small_hosts[f"odd: {odd}"]
    assert_on(result, {gpu: NODE_CPU[node] for gpu, node in GPU_NODE.items()})
    assert not warnings_naming(result, ODD_DEVICE), explain(result)


def test_unreadable_numa_node_of_the_gpu_without_nvml(small_hosts):
    """GPU 1's rank runs unbound with one warning naming the file, the others are
    placed; an error only under SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1."""
    warn, crashed = small_hosts["unreadable numa_node"]
    path = f"/sys/bus/pci/devices/{GPU[1]}/numa_node"
    assert_on(warn, {0: NODE_CPU[0], 1: UNBOUND})
    assert len(warnings_naming(warn, re.escape(path))) == 1, explain(warn)
    row = by_gpu(crashed)[1]
    assert not row["started"] and path in row.get("error", ""), row
