"""``plan`` on hosts this machine is not: fakesys trees passed as ``--sysfs-root``.

Each plan runs the core's own ``resolve_placement`` in a private mount namespace
where the tree is the host's sysfs (through libnuma, lscpu and the stand-in NVML
the tools ship), with the tree's online CPUs as the planning process's own.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import fakesys
import pytest
import tools_hosts
from fakesys import gpu_address

DATA = Path(__file__).resolve().parent / "data"
PROG = "python -m sglang.srt.placement_tools"


SNC = fakesys.Shape(
    sockets=2,
    nodes_per_socket=2,
    cores_per_node=4,
    threads_per_core=2,
    gpus_per_node=2,
    offline_cpus=frozenset({5}),
)
"""Sub-NUMA clustering: 2 packages x 2 nodes of 4 cores x 2 threads, 2 GPUs per node;
CPU 5 is offline (its sibling 21 stays)."""
TWO = fakesys.TWO_SOCKETS_FOUR_GPUS
SPARSE = fakesys.Host(
    nodes={0: fakesys.NodeSpec(cpus=range(4)), 2: fakesys.NodeSpec(cpus=range(4, 8))},
    pci=[fakesys.PciSpec(gpu_address(0), 0), fakesys.PciSpec(gpu_address(1), 2)],
    cores={c: (c // 4, c % 2) for c in range(8)},
)
"""Nodes 0 and 2 only, 2 cores x 2 threads each; GPU 0 on node 0, GPU 1 on node 2."""
GROUPS = {"SGLANG_CPU_OMP_THREADS_BIND": "0-3|8-11,24"}
# name: (host, plan flags, environment); all planned together by the `plans` fixture.
PLANS = {
    "snc": (SNC, ("--tp-size", "8", "--set-cpu-affinity"), None),
    "cpuset": (TWO, ("--tp-size", "4", "--allowed-cpus", "2-5,16-17"), None),
    "pp-dp": (
        fakesys.EIGHT_NODES,
        ("--tp-size", "2", "--pp-size", "2", "--dp-size", "2"),
        None,
    ),
    "base-step": (
        fakesys.EIGHT_NODES,
        (
            "--tp-size",
            "2",
            "--dp-size",
            "2",
            "--base-gpu-id",
            "1",
            "--gpu-id-step",
            "2",
        ),
        None,
    ),
    "numa-node": (TWO, ("--tp-size", "4", "--numa-node", "1", "1", "0", "0"), None),
    "too-short": (TWO, ("--tp-size", "4", "--numa-node", "0", "1"), None),
    "node-the-host-lacks": (
        TWO,
        ("--tp-size", "4", "--numa-node", "0", "0", "1", "5"),
        None,
    ),
    "cpu-groups": (TWO, ("--device", "cpu", "--tp-size", "2"), GROUPS),
    "cpu-all": (
        SPARSE,
        ("--device", "cpu", "--tp-size", "2"),
        {"SGLANG_CPU_OMP_THREADS_BIND": "all"},
    ),
    "container": (
        TWO,
        ("--tp-size", "2", "--gpus", ",".join(TWO.gpu_addresses[2:])),
        None,
    ),
    "visible-ray": (
        TWO,
        ("--tp-size", "2", "--launcher", "ray"),
        {"CUDA_VISIBLE_DEVICES": "2,3"},
    ),
    "sparse": (SPARSE, ("--tp-size", "2"), None),
    "h200": (None, ("--tp-size", "1"), None),
}
TEXT = {"sparse"}
"""Plans printed as text rows; the others as JSON."""


@pytest.fixture(scope="module")
def plans():
    """Every plan of PLANS (each host's tree written first), run together."""
    jobs = {}
    with tempfile.TemporaryDirectory(prefix="tools-plan-") as scratch:
        for name, (spec, flags, env) in PLANS.items():
            root = DATA / "h200_snapshot"
            if spec is not None:
                root = tools_hosts.write_tree(Path(scratch) / name, spec)
            output = [] if name in TEXT else ["--json"]
            jobs[name] = (["plan", "--sysfs-root", str(root), *output, *flags], env)
        done = tools_hosts.run_together(jobs)
    return {**done, "roots": {name: argv[2] for name, (argv, _) in jobs.items()}}


def one_error_line(done: subprocess.CompletedProcess) -> str:
    """Bad input: exit status 2 and one line on stderr, nothing on stdout."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and not done.stdout, done.stderr
    assert lines[0].startswith(PROG), lines
    return lines[0]


def cpus(*spans: range) -> str:
    return fakesys.format_cpulist(set().union(*spans))


def test_sub_numa_clustering_places_each_gpu_on_its_own_node(plans):
    rows = tools_hosts.ranks(plans["snc"])
    assert [row["gpu_id"] for row in rows] == list(range(8))
    assert [row["pci"] for row in rows] == list(SNC.gpu_addresses)
    for row in rows:
        node = row["gpu_id"] // 2
        assert (row["numa_node"], row["mem_policy"], row["mem_nodes"]) == (
            node,
            "bind",
            str(node),
        )
        assert row["strategy"] == "exec" and f"--membind={node}" in row["numactl_args"]
        assert cpu_set(row["cpus"]) <= SNC.cpus_of_node(node), row
        assert "not probed" in row["reason"]


def test_set_cpu_affinity_keeps_smt_siblings_together(plans):
    """Each node's 2 GPUs split its cores in two; a core's threads (c, c + 16) go
    together. Node 1 lost CPU 5: its slices are 4,20,6,22 and 7,23,21 (the core
    whose first thread is offline comes last, by its lowest online CPU)."""
    slices = [cpu_set(row["cpus"]) for row in tools_hosts.ranks(plans["snc"])]
    for cpus_ in slices:
        for cpu in cpus_:
            sibling = cpu + 16 if cpu < 16 else cpu - 16
            assert sibling in cpus_ or sibling == 5, (cpu, cpus_)
    assert slices[0] == {0, 1, 16, 17} and slices[1] == {2, 3, 18, 19}
    assert slices[2] == {4, 6, 20, 22} and slices[3] == {7, 21, 23}
    assert set().union(*slices) == set(range(32)) - {5}


def test_offline_cpus_are_never_planned(plans):
    rows = tools_hosts.ranks(plans["snc"])
    assert all(5 not in cpu_set(row["cpus"]) for row in rows)
    for row in rows:
        cpus_ = row["numactl_args"].split()[0].split("=")[1]
        assert 5 not in cpu_set(cpus_)


def cpu_set(text: str) -> set[int]:
    ids: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        ids.update(range(int(first), int(last or first) + 1))
    return ids


def test_cpuset_allowed_cpus(plans):
    """--allowed-cpus stands for a cpuset: each node's allowed CPUs, and a node with
    none left unbound, saying which node and which CPUs."""
    rows = tools_hosts.ranks(plans["cpuset"])
    for row in rows[:2]:
        assert row["cpus"] == "2-5,16-17" and row["mem_nodes"] == "0"
        assert row["numactl_args"] == "--physcpubind=2,3,4,5,16,17 --membind=0"
    for row in rows[2:]:
        assert row["strategy"] == "none" and row["cpus"] == ""
    assert "NUMA node 1 has no CPU cores allowed" in plans["cpuset"].stderr


@pytest.mark.parametrize("name", ["pp-dp", "base-step"])
def test_rank_arithmetic(plans, name):
    """sglang's own: base_gpu_id + (pp_rank % pp_per_node) * tp_per_node + (tp_rank %
    tp_per_node) * gpu_id_step, plus tp x pp x step per data-parallel rank; one GPU per
    node here, so each rank's node is its GPU id."""
    rows = tools_hosts.ranks(plans[name])
    flags = PLANS[name][1]
    given = dict(zip(flags[::2], map(int, flags[1::2])))
    tp, pp = given["--tp-size"], given.get("--pp-size", 1)
    base, step = given.get("--base-gpu-id", 0), given.get("--gpu-id-step", 1)
    expected = [
        (dp, p, t, base + dp * tp * pp * step + p * tp + t * step)
        for dp in range(given["--dp-size"])
        for p in range(pp)
        for t in range(tp)
    ]
    got = [(r["dp_rank"], r["pp_rank"], r["tp_rank"], r["gpu_id"]) for r in rows]
    assert got == expected
    for row in rows:
        assert row["numa_node"] == row["gpu_id"]
        assert row["pci"] == gpu_address(row["gpu_id"])


def test_numa_node_per_gpu_id(plans):
    rows = tools_hosts.ranks(plans["numa-node"])
    assert [row["numa_node"] for row in rows] == [1, 1, 0, 0]
    assert rows[0]["cpus"] == "8-15,24-31"
    assert all("from --numa-node" in row["reason"] for row in rows)


@pytest.mark.parametrize(
    "name, message",
    [
        ("too-short", "--numa-node 0 1 has no entry for GPU 2"),
        ("node-the-host-lacks", "names NUMA node 5, which this host lacks"),
    ],
)
def test_numa_node_errors(plans, name, message):
    assert message in one_error_line(plans[name])


def test_cpu_device_groups(plans):
    rows = tools_hosts.ranks(plans["cpu-groups"])
    assert [(r["cpus"], r["mem_nodes"]) for r in rows] == [
        ("0-3", "0"),
        ("8-11,24", "1"),
    ]
    assert rows[1]["numactl_args"] == "--physcpubind=8,9,10,11,24 --membind=1"
    assert all(r["pci"] is None and r["strategy"] == "exec" for r in rows)


def test_cpu_device_all_gives_rank_i_node_i(plans):
    """``all``: rank i gets the i-th node with CPUs (nodes 0 and 2 here), its physical
    cores (one thread of each), as init_threads_binding gives them."""
    rows = tools_hosts.ranks(plans["cpu-all"])
    assert [(r["numa_node"], r["cpus"], r["mem_nodes"]) for r in rows] == [
        (0, "0-1", "0"),
        (2, "4-5", "2"),
    ]


def test_container_given_some_gpus(plans):
    """A container given GPUs 2 and 3 of the host: NVML (--gpus) lists only those, as
    device 0 and 1, while sysfs shows all four."""
    rows = tools_hosts.ranks(plans["container"])
    assert [(r["gpu_id"], r["pci"], r["numa_node"]) for r in rows] == [
        (0, gpu_address(2), 1),
        (1, gpu_address(3), 1),
    ]


def test_cuda_visible_devices_for_ray_actors(plans):
    """CUDA_VISIBLE_DEVICES=2,3: Ray gives its actors GPUs 2 and 3 by those ids; each
    actor binds itself (in-process) to its GPU's node, preferring its memory."""
    rows = tools_hosts.ranks(plans["visible-ray"])
    assert [(r["gpu_id"], r["pci"], r["numa_node"]) for r in rows] == [
        (2, gpu_address(2), 1),
        (3, gpu_address(3), 1),
    ]
    for row in rows:
        assert (row["strategy"], row["mem_policy"], row["cpus"]) == (
            "in-process",
            "preferred",
            "8-15,24-31",
        )


def test_sparse_node_ids_in_text_rows(plans):
    """Nodes 0 and 2 only: NVML's affinity mask reaches node 2, and the host counts
    as a NUMA host without a node 1. One text row per rank."""
    done, root = plans["sparse"], plans["roots"]["sparse"]
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"[DP0 PP0 TP{i}] GPU {i} ({gpu_address(i)}): node {node} CPUs {cpus} membind "
        f"{node} via exec -- node {node} from its GPU's NUMA affinity; exec under "
        f"numactl --cpunodebind={node} --membind={node}; planned from {root}: "
        "numactl there not probed"
        for i, node, cpus in ((0, 0, "0-3"), (1, 2, "4-7"))
    ]


def test_one_node_h200_host_binds_nothing_and_says_why(plans):
    """A captured one-GPU cloud VM: one NUMA node, the GPU's numa_node is -1."""
    rows = tools_hosts.ranks(plans["h200"])
    assert [(r["pci"], r["strategy"], r["cpus"]) for r in rows] == [
        ("0000:00:06.0", "none", "")
    ]
    assert "no NUMA node for its GPU" in rows[0]["reason"]


@pytest.mark.parametrize(
    "argv, names",
    [
        (["plan", "--tp-size", "0"], "--tp-size"),
        (["plan", "--device", "tpu"], "--device"),
        (["plan", "--launcher", "k8s"], "--launcher"),
        (["plan", "--nnodes", "2", "--node-rank", "2"], "--node-rank"),
        (["plan", "--sysfs-root", "/nonexistent"], "--sysfs-root /nonexistent"),
        (["plan", "--gpus", "18:00.0x"], "--gpus"),
        (["plan", "--allowed-cpus", "3-1"], "--allowed-cpus"),
        (
            ["plan", "--sysfs-root", str(DATA / "h200_snapshot"), "--tp-size", "2"],
            "--sysfs-root",
        ),
        (["verify", "--timeout", "nan"], "--timeout"),
        (["verify", "--sysfs-root", "x"], "--sysfs-root"),
        (["capture", "/"], "DIR /"),
    ],
)
def test_bad_input_exits_2_naming_the_flag(argv, names):
    """Checked before anything is imported or started."""
    assert names in one_error_line(tools_hosts.run_tools(argv))
