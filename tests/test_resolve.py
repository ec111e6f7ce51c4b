"""resolve_placement / plan_engine on topologies built as values (the sysfs reader has its own tests)."""

from __future__ import annotations

import dataclasses
import json
import os
import stat

import fakesys
import pytest
from conftest import setting

from sglang.srt.environ import envs
from sglang.srt.placement import settings
from sglang.srt.placement.numactl import NumactlProber
from sglang.srt.placement.resolve import HostCapabilities, HostFacts, place_gpu_id
from sglang.srt.placement.settings import PlacementPolicy, SettingError
from sglang.srt.placement.topology import read_topology
from sglang.srt.placement.types import (
    Cpu,
    HostTopology,
    NumaNode,
    PciDevice,
    PlacementError,
    ProcessAffinity,
    RankIdentity,
)
from sglang.srt.placement_tools import PlanArgs as EngineArgs
from sglang.srt.placement_tools import UsageError as EngineArgsError
from sglang.srt.placement_tools.engine import (
    from_dict,
    local_ranks,
    plan_engine,
    to_dict,
)


def make_topology(nodes, *, pci=(), smt=1, packages=None, root="/fake/sys"):
    """nodes: {node_id: (cpu ids, memory_kb)}; pci: [(address, numa_node or None)]; smt: threads per core
    (siblings are cpu ids c and c + half of the node's CPUs, like a real x86 numbering within a node).
    """
    numa_nodes = []
    cpus = []
    for node_id, (cpu_ids, mem) in sorted(nodes.items()):
        cpu_ids = sorted(cpu_ids)
        numa_nodes.append(
            NumaNode(node_id=node_id, cpus=frozenset(cpu_ids), memory_kb=mem)
        )
        half = len(cpu_ids) // smt if smt > 1 else len(cpu_ids)
        for i, c in enumerate(cpu_ids):
            core = i % half
            siblings = frozenset(
                cpu_ids[j] for j in range(len(cpu_ids)) if j % half == core
            )
            pkg = packages[node_id] if packages else node_id
            cpus.append(
                Cpu(
                    cpu_id=c,
                    node_id=node_id,
                    package_id=pkg,
                    core_id=core,
                    thread_siblings=siblings,
                )
            )
    devices = tuple(
        PciDevice(address=a, numa_node=n, vendor="0x10de", pci_class="0x030200")
        for a, n in pci
    )
    online = frozenset(c.cpu_id for c in cpus)
    return HostTopology(
        root=root,
        nodes=tuple(numa_nodes),
        cpus=tuple(sorted(cpus, key=lambda c: c.cpu_id)),
        online_cpus=online,
        pci_devices=devices,
    )


def everything(topology):
    return ProcessAffinity(
        cpus=topology.online_cpus,
        mems=frozenset(n.node_id for n in topology.nodes if n.has_memory),
        source="test",
    )


class AcceptAll:
    """A prober whose kernel accepts every numactl option, probing each set once like the real one."""

    def __init__(self):
        self.prober = NumactlProber(numactl_path="/usr/bin/numactl")
        self.calls = []
        real = self.prober.probe

        def run(argv):
            self.calls.append(tuple(argv))
            return None

        def probe(args):  # the real cache, over a kernel that accepts everything
            import unittest.mock

            with unittest.mock.patch("sglang.srt.placement.numactl.run_numactl", run):
                return real(args)

        self.prober.probe = probe


def caps(*, libnuma=True):
    return HostCapabilities(numactl=AcceptAll().prober, libnuma=libnuma)


GPUS_2x4 = [
    ("0000:17:00.0", 0),
    ("0000:31:00.0", 0),
    ("0000:b1:00.0", 1),
    ("0000:ca:00.0", 1),
]


@pytest.fixture
def two_sockets():
    return make_topology(
        {0: (range(0, 16), 1 << 25), 1: (range(16, 32), 1 << 25)}, pci=GPUS_2x4, smt=2
    )


def plan(
    topology, *, env=None, affinity=None, capabilities=None, launcher="mp", **server
):
    server.setdefault("tp_size", 4)
    facts = HostFacts(
        topology=topology,
        affinity=affinity or everything(topology),
        capabilities=capabilities or caps(),
    )
    return plan_engine(
        EngineArgs(**server),
        launcher=launcher,
        facts=facts,
        env=env or {},
    )


def test_two_sockets_four_gpus_bind_each_gpu_to_its_node(two_sockets):
    placements = plan(two_sockets)
    assert [p.numa_node for p in placements] == [0, 0, 1, 1]
    assert [p.pci for p in placements] == [a for a, _ in GPUS_2x4]
    first, last = placements[0], placements[3]
    assert first.cpus == frozenset(range(16)) and first.mem_nodes == frozenset({0})
    assert first.numactl_args == ("--cpunodebind=0", "--membind=0")
    assert last.numactl_args == ("--cpunodebind=1", "--membind=1")
    assert all(p.strategy == "exec" and p.mem_policy == "bind" for p in placements)
    assert "node 1 from PCI 0000:ca:00.0" in last.reasons


def test_one_node_host_binds_nothing_and_says_why():
    topo = make_topology({0: (range(4), 1 << 20)}, pci=[("0000:01:00.0", 0)])
    (p,) = plan(topo, tp_size=1)
    assert p.strategy == "none" and p.numa_node is None and not p.cpus
    assert any("one NUMA node" in r for r in p.reasons)
    assert not p.degraded


def test_gpu_with_unknown_node_is_unbound_with_reason():
    topo = make_topology(
        {0: (range(4), 1 << 20), 1: (range(4, 8), 1 << 20)},
        pci=[("0000:01:00.0", None)],
    )
    (p,) = plan(topo, tp_size=1)
    assert p.strategy == "none" and p.numa_node is None
    assert any("numa_node -1" in r for r in p.reasons)


def test_unknown_node_on_one_node_host_in_exclusive_mode_uses_that_node():
    topo = make_topology(
        {0: (range(4), 1 << 20)}, pci=[("0000:01:00.0", None), ("0000:02:00.0", None)]
    )
    with envs.SGLANG_NUMA_AFFINITY_MODE.override("exclusive"):
        placements = plan(topo, tp_size=2)
    assert [p.cpus for p in placements] == [frozenset({0, 1}), frozenset({2, 3})]
    assert placements[0].numactl_args == ("--physcpubind=0-1", "--membind=0")


def test_sparse_node_ids():
    topo = make_topology(
        {0: (range(0, 4), 1 << 20), 2: (range(4, 8), 1 << 20)},
        pci=[("0000:01:00.0", 0), ("0000:81:00.0", 2)],
    )
    placements = plan(topo, tp_size=2)
    assert [p.numa_node for p in placements] == [0, 2]
    assert placements[1].numactl_args == ("--cpunodebind=2", "--membind=2")


def test_gpu_on_cpuless_memory_node_is_unbound_as_a_fault():
    topo = make_topology(
        {0: (range(0, 4), 1 << 20), 1: (range(4, 8), 1 << 20), 2: ((), 1 << 22)},
        pci=[("0000:01:00.0", 2)],
    )
    (p,) = plan(topo, tp_size=1)
    assert p.strategy == "none" and p.degraded
    assert "node 2 has memory but no CPUs" in p.reasons


def test_node_without_memory_binds_cpus_only():
    topo = make_topology(
        {0: (range(0, 4), 0), 1: (range(4, 8), 1 << 20)}, pci=[("0000:01:00.0", 0)]
    )
    (p,) = plan(topo, tp_size=1)
    assert p.strategy == "exec" and p.mem_policy == "none"
    assert p.numactl_args == ("--cpunodebind=0",)


def test_cpuset_allowing_part_of_one_node_and_none_of_another(two_sockets):
    allowed = ProcessAffinity(
        cpus=frozenset(range(0, 8)), mems=frozenset({0, 1}), source="cpuset"
    )
    placements = plan(two_sockets, affinity=allowed)
    assert placements[0].cpus == frozenset(range(8))
    assert placements[0].numactl_args == ("--physcpubind=0-7", "--membind=0")
    assert "cpuset allows 8 of 16 CPUs of node(s) 0" in placements[0].reasons
    assert placements[2].strategy == "none" and placements[2].degraded
    assert any(
        "NUMA node 1 has no CPU cores allowed by the current affinity 0-7" in r
        for r in placements[2].reasons
    )


def test_memory_node_outside_mems_allowed_is_not_membound(two_sockets):
    allowed = ProcessAffinity(
        cpus=two_sockets.online_cpus, mems=frozenset({0}), source="cpuset"
    )
    placements = plan(two_sockets, affinity=allowed)
    assert placements[2].mem_policy == "none" and placements[2].numactl_args == (
        "--cpunodebind=1",
    )


def test_cuda_visible_devices_reordered(two_sockets):
    placements = plan(two_sockets, env={"CUDA_VISIBLE_DEVICES": "3,2,1,0"})
    assert [p.numa_node for p in placements] == [1, 1, 0, 0]
    assert placements[0].pci == "0000:ca:00.0"


def test_explicit_numa_node_list_wins_and_is_indexed_by_gpu_id(two_sockets):
    placements = plan(two_sockets, numa_node=[1, 1, 0, 0])
    assert [p.numa_node for p in placements] == [1, 1, 0, 0]
    assert "node 1 from --numa-node (GPU 0)" in placements[0].reasons


def test_explicit_numa_node_list_too_short(two_sockets):
    with pytest.raises(
        PlacementError,
        match=r"--numa-node has 2 entries \(0 1\) but DP0 PP0 TP2 uses GPU 2",
    ):
        plan(two_sockets, numa_node=[0, 1])


def test_explicit_numa_node_that_does_not_exist(two_sockets):
    with pytest.raises(
        PlacementError,
        match="--numa-node gives node 5 for GPU 0, but this host has nodes 0-1",
    ):
        plan(two_sockets, numa_node=[5, 0, 1, 1])


def test_explicit_numa_node_is_honoured_on_a_one_node_host():
    topo = make_topology({0: (range(4), 1 << 20)}, pci=[("0000:01:00.0", 0)])
    (p,) = plan(topo, tp_size=1, numa_node=[0])
    assert p.strategy == "exec" and p.numactl_args == ("--cpunodebind=0", "--membind=0")


def test_auto_bind_off_without_list_binds_nothing(two_sockets):
    with envs.SGLANG_AUTO_NUMA_BIND.override(False):
        placements = plan(two_sockets)
    assert all(p.strategy == "none" and not p.degraded for p in placements)
    assert "SGLANG_AUTO_NUMA_BIND=0" in placements[0].reasons[0]


def test_exclusive_mode_splits_each_node_keeping_smt_siblings_together(two_sockets):
    with envs.SGLANG_NUMA_AFFINITY_MODE.override("exclusive"):
        placements = plan(two_sockets)
    # node 0: CPUs 0-15, siblings (c, c+8): 8 cores split 4 + 4
    assert placements[0].cpus == frozenset({0, 1, 2, 3, 8, 9, 10, 11})
    assert placements[1].cpus == frozenset({4, 5, 6, 7, 12, 13, 14, 15})
    assert placements[2].cpus == frozenset({16, 17, 18, 19, 24, 25, 26, 27})
    assert placements[0].numactl_args == ("--physcpubind=0-3,8-11", "--membind=0")
    all_cpus = [p.cpus for p in placements]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not all_cpus[i] & all_cpus[j]


def test_exclusive_split_near_equal_when_uneven():
    topo = make_topology(
        {0: (range(0, 5), 1 << 20)},
        pci=[(f"0000:{bus:02x}:00.0", 0) for bus in (1, 2, 3)],
    )
    with envs.SGLANG_NUMA_AFFINITY_MODE.override("exclusive"):
        slices = [p.cpus for p in plan(topo, tp_size=3)]
    assert slices == [frozenset({0, 1}), frozenset({2, 3}), frozenset({4})]


def test_socket_mode_binds_every_node_of_the_package():
    # sub-NUMA clustering: 2 packages x 2 nodes, 2 GPUs per node
    nodes = {n: (range(n * 4, n * 4 + 4), 1 << 20) for n in range(4)}
    pci = [(f"0000:{0x10 * (i + 1):02x}:00.0", i // 2) for i in range(8)]
    topo = make_topology(nodes, pci=pci, packages={0: 0, 1: 0, 2: 1, 3: 1})
    with envs.SGLANG_NUMA_AFFINITY_MODE.override("socket"):
        placements = plan(topo, tp_size=8)
    assert placements[0].cpus == frozenset(range(8)) and placements[
        0
    ].mem_nodes == frozenset({0, 1})
    assert placements[0].numactl_args == ("--cpunodebind=0-1", "--membind=0-1")
    assert placements[7].numa_node == 3 and placements[7].cpus == frozenset(
        range(8, 16)
    )
    with envs.SGLANG_NUMA_AFFINITY_MODE.override("node"):
        node_mode = plan(topo, tp_size=8)
    assert (
        node_mode[2].cpus == frozenset(range(4, 8))
        and node_mode[2].numactl_args[0] == "--cpunodebind=1"
    )


def test_v1_binds_the_whole_node_whatever_the_affinity_mode(two_sockets):
    """The legacy bind is numa_bind_to_node(node): the plan shows that, not a share."""
    with envs.SGLANG_NUMA_BIND_V2.override(False):
        with envs.SGLANG_NUMA_AFFINITY_MODE.override("exclusive"):
            placements = plan(two_sockets)
    nodes = {n.node_id: n.cpus for n in two_sockets.nodes}
    assert [p.cpus for p in placements] == [nodes[0], nodes[0], nodes[1], nodes[1]]
    assert all(p.strategy == "v1" for p in placements)


def test_v1_strategy_when_bind_v2_is_off(two_sockets):
    with envs.SGLANG_NUMA_BIND_V2.override(False):
        placements = plan(two_sockets, numa_node=[0, 0, 1, 1])
    assert all(
        p.strategy == "v1" and not p.numactl_args and p.mem_policy == "preferred"
        for p in placements
    )
    assert placements[2].numa_node == 1


def test_without_numactl_a_spawned_rank_is_unbound_and_a_ray_rank_binds_in_process(
    two_sockets,
):
    # sglang's spawned scheduler runs sglang's own code: only exec can bind it.
    p = plan(two_sockets, capabilities=HostCapabilities(numactl=None, libnuma=True))[0]
    assert (
        p.strategy == "none" and p.degraded and "numactl is not installed" in p.reasons
    )
    assert "the mp launcher binds only by exec: running unbound" in p.reasons
    p = plan(
        two_sockets,
        launcher="ray",
        capabilities=HostCapabilities(numactl=None, libnuma=True),
    )[0]
    assert (
        p.strategy == "in-process"
        and p.mem_policy == "bind"
        and "the ray launcher cannot start this rank under numactl" in p.reasons
    )
    p = plan(
        two_sockets,
        launcher="ray",
        capabilities=HostCapabilities(numactl=None, libnuma=False),
    )[0]
    assert p.strategy == "in-process" and p.mem_policy == "none" and p.degraded


def test_launcher_that_cannot_exec_uses_in_process(two_sockets):
    policy = PlacementPolicy(launcher="ray", device="cuda")
    facts = HostFacts(
        topology=two_sockets, affinity=everything(two_sockets), capabilities=caps()
    )
    placements = plan_engine(EngineArgs(tp_size=4), facts=facts, env={}, policy=policy)
    assert all(p.strategy == "in-process" for p in placements)
    assert (
        "the ray launcher cannot start this rank under numactl" in placements[0].reasons
    )


def test_placement_json_round_trip(two_sockets):
    for p in plan(two_sockets):
        assert from_dict(json.loads(json.dumps(to_dict(p)))) == p


# --- the probe ladder -------------------------------------------------------------------------


def _fake_numactl(tmp_path, *, reject):
    """An executable that behaves like numactl whose kernel refuses the given option prefixes."""
    script = tmp_path / "numactl"
    cases = "\n".join(
        f'    {opt}=*) echo "set_mempolicy: Operation not permitted ({opt})" >&2; exit 1;;'
        for opt in reject
    )
    script.write_text(
        f'#!/bin/sh\nfor a in "$@"; do\n  case "$a" in\n{cases}\n  esac\ndone\nexit 0\n'
    )
    script.chmod(stat.S_IRWXU)
    return str(script)


def test_ladder_falls_back_from_bind_to_preferred_to_cpu_only(tmp_path, two_sockets):
    prober = NumactlProber(numactl_path=_fake_numactl(tmp_path, reject=["--membind"]))
    p = plan(two_sockets, capabilities=HostCapabilities(numactl=prober, libnuma=True))[
        0
    ]
    assert p.strategy == "exec" and p.mem_policy == "preferred" and p.degraded
    assert p.numactl_args == ("--cpunodebind=0", "--preferred=0")
    assert (
        "numactl rejected hard memory binding ('--cpunodebind=0 --membind=0'): set_mempolicy: Operation "
        "not permitted (--membind); falling back to soft preferred policy ('--cpunodebind=0 --preferred=0')"
        in p.reasons
    )

    prober = NumactlProber(
        numactl_path=_fake_numactl(tmp_path, reject=["--membind", "--preferred"])
    )
    p = plan(two_sockets, capabilities=HostCapabilities(numactl=prober, libnuma=True))[
        0
    ]
    assert p.mem_policy == "none" and p.numactl_args == ("--cpunodebind=0",)
    assert any(
        r.endswith("falling back to CPU-only binding ('--cpunodebind=0')")
        for r in p.reasons
    ), p.reasons


def test_ladder_exhausted_leaves_a_spawned_rank_unbound_and_a_ray_rank_in_process(
    tmp_path, two_sockets
):
    prober = NumactlProber(
        numactl_path=_fake_numactl(
            tmp_path, reject=["--membind", "--preferred", "--cpunodebind"]
        )
    )
    p = plan(two_sockets, capabilities=HostCapabilities(numactl=prober, libnuma=True))[
        0
    ]
    assert p.strategy == "none" and p.degraded
    assert any(
        r.startswith("numactl could not apply NUMA binding for node 0")
        and r.endswith("set_mempolicy: Operation not permitted (--cpunodebind)")
        for r in p.reasons
    ), p.reasons
    p = plan(
        two_sockets,
        launcher="ray",
        capabilities=HostCapabilities(numactl=prober, libnuma=True),
    )[0]
    assert p.strategy == "in-process"


def test_each_distinct_option_set_is_probed_once(two_sockets):
    fake = AcceptAll()
    capabilities = HostCapabilities(numactl=fake.prober, libnuma=True)
    plan(
        two_sockets,
        capabilities=capabilities,
        tp_size=4,
        dp_size=2,
        env={"CUDA_VISIBLE_DEVICES": "0,1,2,3,0,1,2,3"},
    )
    plan(two_sockets, capabilities=capabilities)
    assert sorted(c[1:-1] for c in fake.calls) == [
        ("--cpunodebind=0", "--membind=0"),
        ("--cpunodebind=1", "--membind=1"),
    ]


def test_real_numactl_probe_on_this_host():
    from sglang.srt.placement.numactl import find_numactl

    path = find_numactl()
    assert path, "numactl must be installed (scripts/setup.sh installs it)"
    prober = NumactlProber(numactl_path=path)
    cpu = min(os.sched_getaffinity(0))
    ok = prober.ladder(
        cpu_args=(f"--physcpubind={cpu}",),
        mem_policy="bind",
        mem_nodes=(0,),
        preferred_node=0,
    )
    assert (
        ok.ok
        and ok.mem_policy == "bind"
        and ok.args == (f"--physcpubind={cpu}", "--membind=0")
    )
    bad = prober.probe(("--membind=7",))
    assert bad  # numactl's own words, e.g. "numactl: ... 7 ..."
    assert len(prober._results) == 2
    assert prober.probe(("--membind=7",)) == bad and len(prober._results) == 2


# --- CPU device ---------------------------------------------------------------------------------


def test_cpu_device_ranks_from_explicit_groups(two_sockets):
    with setting("SGLANG_CPU_OMP_THREADS_BIND", "0-7|16-23"):
        placements = plan(two_sockets, tp_size=2, device="cpu")
    assert [p.cpus for p in placements] == [
        frozenset(range(8)),
        frozenset(range(16, 24)),
    ]
    assert [p.numa_node for p in placements] == [0, 1]
    assert placements[1].numactl_args == ("--physcpubind=16-23", "--membind=1")
    assert [p.rank.gpu_id for p in placements] == [
        0,
        1,
    ]  # a CPU rank's id is the numa_index bootstrap uses


def test_cpu_device_all_gives_one_node_per_rank(two_sockets):
    placements = plan(two_sockets, tp_size=2, device="cpu")
    assert [p.numactl_args for p in placements] == [
        ("--cpunodebind=0", "--membind=0"),
        ("--cpunodebind=1", "--membind=1"),
    ]


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            "0-7",
            r"has 1 group\(s\) but rank index 1 needs one more: give one '\|'-separated cpulist per rank "
            r"\(dp_size x tp_size x pp_size, across all data-parallel workers\), "
            r"e\.g\. SGLANG_CPU_OMP_THREADS_BIND='0-15\|16-31'",
        ),
        ("0-7|x", r"group 1 'x' is not a cpulist; expected ranges such as '0-3,8'"),
        ("0-7|", r"group 1 is empty"),
        (
            "0-7|40-41",
            r"group 1 '40-41' names CPU\(s\) 40-41 that are not online on this host \(online: 0-31\)",
        ),
        ("7-3|8", r"group 0 '7-3' is not a cpulist"),
    ],
)
def test_cpu_threads_bind_errors(two_sockets, spec, message):
    with setting("SGLANG_CPU_OMP_THREADS_BIND", spec):
        with pytest.raises(ValueError, match=message):
            plan(two_sockets, tp_size=2, device="cpu")


def test_cpu_threads_bind_all_with_more_ranks_than_nodes(two_sockets):
    with pytest.raises(
        ValueError,
        match=r"=all gives each rank one NUMA node, but rank index 2 has none: this "
        r"host has 2 node\(s\) with CPUs",
    ):
        plan(two_sockets, tp_size=4, device="cpu")


def test_cpu_threads_bind_outside_allowed_cpus(two_sockets):
    allowed = ProcessAffinity(
        cpus=frozenset(range(8)), mems=frozenset({0}), source="cpuset"
    )
    with envs.SGLANG_CPU_OMP_THREADS_BIND.override("0-3|8-11"):
        with pytest.raises(
            ValueError,
            match=r"group 1 '8-11' names CPU\(s\) 8-11 that this process may not use "
            r"\(cpuset allows 0-7\)",
        ):
            plan(two_sockets, tp_size=2, device="cpu", affinity=allowed)


# --- rank layout, policy and input validation --------------------------------------------------


def test_engine_formula_gives_upstreams_gpu_ids():
    """entrypoints/engine.py: base + (pp % pp_per_node) * tp_per_node + (tp % tp_per_node) * step. The step
    applies to the TP offset only, so with pp > 1 and step > 1 upstream gives two ranks GPU 3.
    """
    ranks = local_ranks(EngineArgs(tp_size=2, pp_size=2, base_gpu_id=1, gpu_id_step=2))
    assert [(r.pp_rank, r.tp_rank, r.gpu_id) for r in ranks] == [
        (0, 0, 1),
        (0, 1, 3),
        (1, 0, 3),
        (1, 1, 5),
    ]
    node1 = local_ranks(EngineArgs(tp_size=4, nnodes=2, node_rank=1))
    assert [(r.tp_rank, r.gpu_id) for r in node1] == [(2, 0), (3, 1)]
    stages = local_ranks(EngineArgs(tp_size=2, pp_size=2, nnodes=2, node_rank=1))
    assert [(r.pp_rank, r.tp_rank, r.gpu_id) for r in stages] == [(1, 0, 0), (1, 1, 1)]


def test_data_parallel_controller_formula_gives_upstreams_gpu_ids():
    """managers/data_parallel_controller.py: each dp rank's group starts tp_size * pp_size * step ids after
    the previous one's, on top of --base-gpu-id."""
    dp = local_ranks(EngineArgs(tp_size=2, dp_size=2))
    assert [(r.dp_rank, r.tp_rank, r.gpu_id) for r in dp] == [
        (0, 0, 0),
        (0, 1, 1),
        (1, 0, 2),
        (1, 1, 3),
    ]
    stepped = local_ranks(
        EngineArgs(tp_size=2, dp_size=2, gpu_id_step=2, base_gpu_id=1)
    )
    assert [r.gpu_id for r in stepped] == [1, 3, 5, 7]
    staged = local_ranks(EngineArgs(tp_size=2, pp_size=2, dp_size=2, gpu_id_step=2))
    assert [r.gpu_id for r in staged] == [0, 2, 2, 4, 8, 10, 10, 12]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tp_size=0), r"--tp-size=0 is not valid: it must be a positive integer"),
        (dict(nnodes=2, node_rank=2), r"--node-rank=2 is not valid with --nnodes=2"),
        (dict(tp_size=3, nnodes=2), r"cannot be split evenly over --nnodes=2"),
        (
            dict(device="npu"),
            r"--device='npu' is not supported here: choose one of cuda, xpu, cpu",
        ),
        (dict(numa_node=[0, -1]), r"--numa-node contains -1"),
        (dict(numa_node=[]), r"--numa-node=\[\] is not valid"),
        (dict(base_gpu_id=-1), r"--base-gpu-id=-1 is not valid"),
    ],
)
def test_server_args_errors(kwargs, message):
    with pytest.raises(EngineArgsError, match=message):
        EngineArgs(**kwargs)


@pytest.mark.parametrize(
    "field, value, reader, message",
    [
        (
            "SGLANG_NUMA_AFFINITY_MODE",
            "cores",
            settings.affinity_mode,
            r"SGLANG_NUMA_AFFINITY_MODE='cores' is not valid: choose one of node, exclusive, socket",
        ),
        (
            "SGLANG_CPU_OMP_THREADS_BIND",
            " ",
            settings.cpu_threads_bind,
            r"SGLANG_CPU_OMP_THREADS_BIND is empty",
        ),
        (
            "SGLANG_SYSFS_ROOT",
            "",
            settings.sysfs_root,
            r"SGLANG_SYSFS_ROOT='' is not valid",
        ),
    ],
)
def test_malformed_placement_settings_name_the_variable(field, value, reader, message):
    with getattr(envs, field).override(value):
        with pytest.raises(SettingError, match=message):
            reader()


@pytest.mark.parametrize(
    "field, reader",
    [
        ("SGLANG_NUMA_BIND_V2", settings.bind_v2),
        ("SGLANG_AUTO_NUMA_BIND", settings.auto_numa_bind),
        ("SGLANG_CRASH_ON_NUMA_BIND_FAILURE", settings.bind_failure_is_fatal),
    ],
)
def test_a_malformed_boolean_warns_and_keeps_upstreams_default(field, reader):
    default = reader()
    with getattr(envs, field).override("maybe"), pytest.warns(
        UserWarning, match=f"Invalid value for {field}"
    ):
        assert reader() is default


def test_settings_defaults_and_override_restores_absence():
    os.environ.pop("SGLANG_NUMA_BIND_V2", None)
    assert settings.bind_v2() is True and not envs.SGLANG_NUMA_BIND_V2.is_set()
    with envs.SGLANG_NUMA_BIND_V2.override(False):
        assert (
            os.environ["SGLANG_NUMA_BIND_V2"] == "False" and settings.bind_v2() is False
        )
    assert "SGLANG_NUMA_BIND_V2" not in os.environ
    assert settings.auto_numa_bind() is True
    assert settings.bind_failure_is_fatal() is False
    assert settings.cpu_threads_bind() == "all"
    assert settings.affinity_mode() == "node"
    assert settings.sysfs_root() == "/sys"


def test_policy_rejects_unknown_launcher_and_mode():
    with pytest.raises(ValueError, match="launcher 'slurm' is not one of mp, ray"):
        PlacementPolicy(launcher="slurm", device="cuda")
    with pytest.raises(ValueError, match="--numa-affinity-mode='cores' is not valid"):
        PlacementPolicy(launcher="mp", device="cuda", affinity_mode="cores")


def test_rank_identity_label():
    assert (
        RankIdentity(dp_rank=1, pp_rank=0, tp_rank=3, gpu_id=3).label == "DP1 PP0 TP3"
    )


def test_a_gpu_id_probes_only_its_own_options(two_sockets, monkeypatch):
    from sglang.srt.placement.resolve import place_gpu_id

    fake = AcceptAll()
    facts = HostFacts(
        topology=two_sockets,
        affinity=everything(two_sockets),
        capabilities=HostCapabilities(numactl=fake.prober, libnuma=True),
    )
    monkeypatch.setenv("SGLANG_NUMA_AFFINITY_MODE", "exclusive")
    args = EngineArgs(tp_size=4)
    p = place_gpu_id(
        1, policy=PlacementPolicy.from_env(args, launcher="mp"), facts=facts, env={}
    )
    assert p.cpus == frozenset({4, 5, 6, 7, 12, 13, 14, 15})
    assert [c[1:-1] for c in fake.calls] == [("--physcpubind=4-7,12-15", "--membind=0")]


# --- exclusive and core-complex: each GPU's share of its node, from sysfs alone ----------------

# Nodes 0 and 1, 4 cores x 2 threads each (CPU c and c + 8 are siblings), two L3 groups of two
# cores per node, GPUs 0000:18:00.0 and 0000:28:00.0 on node 0, 0000:38:00.0 and 0000:48:00.0 on 1.
L3_HOST = fakesys.Shape(
    sockets=2, cores_per_node=4, threads_per_core=2, gpus_per_node=2, l3_per_node=2
)
L3_SHARES = [
    frozenset({0, 1, 8, 9}),
    frozenset({2, 3, 10, 11}),
    frozenset({4, 5, 12, 13}),
    frozenset({6, 7, 14, 15}),
]


def sysfs(tmp_path, spec):
    return read_topology(fakesys.write_sysfs(tmp_path / "sys", spec))


def in_mode(mode, topology, **server):
    with setting("SGLANG_NUMA_AFFINITY_MODE", mode):
        return plan(topology, **server)


def share(p):
    """What a GPU gets, whichever path placed it (rank labels differ by path)."""
    return (p.pci, p.numa_node, p.cpus, p.mem_nodes, p.numactl_args, p.degraded)


@pytest.mark.parametrize("mode", ["exclusive", "core-complex"])
def test_each_gpu_gets_its_share_of_its_node(tmp_path, mode):
    placements = in_mode(mode, sysfs(tmp_path, L3_HOST))
    assert [p.cpus for p in placements] == L3_SHARES
    assert placements[1].numactl_args == ("--physcpubind=2-3,10-11", "--membind=0")
    assert placements[3].numactl_args == ("--physcpubind=6-7,14-15", "--membind=1")
    assert not any(p.degraded for p in placements)
    assert f"{mode} mode: GPU 2 of 2 on node 0 (PCI order)" in " ".join(
        placements[1].reasons
    )


@pytest.mark.parametrize("mode", ["exclusive", "core-complex"])
def test_a_gpus_share_is_the_same_whoever_computes_it(tmp_path, mode):
    """The engine's plan, a tp=1 engine at --base-gpu-id, a spawn alone for that id and a
    Ray actor under its one visible GPU all give a GPU the same CPUs."""
    topology = sysfs(tmp_path, L3_HOST)
    facts = HostFacts(
        topology=topology, affinity=everything(topology), capabilities=caps()
    )
    with setting("SGLANG_NUMA_AFFINITY_MODE", mode):
        policy = PlacementPolicy.from_env(EngineArgs(), launcher="mp")
    engine = plan_engine(EngineArgs(tp_size=4), facts=facts, env={}, policy=policy)
    assert [p.cpus for p in engine] == L3_SHARES
    for gpu in range(4):
        alone = EngineArgs(tp_size=1, base_gpu_id=gpu)
        (router,) = plan_engine(alone, facts=facts, env={}, policy=policy)
        spawned = place_gpu_id(gpu, policy=policy, facts=facts, env={})
        actor = place_gpu_id(
            0, policy=policy, facts=facts, env={"CUDA_VISIBLE_DEVICES": str(gpu)}
        )
        assert {share(p) for p in (engine[gpu], router, spawned, actor)} == {
            share(engine[gpu])
        }


def test_the_modes_differ_where_the_process_may_use_part_of_a_node(tmp_path):
    """exclusive shares out the allowed cores; core-complex keeps each L3 group's allowed CPUs."""
    topology = sysfs(tmp_path, L3_HOST)
    allowed = ProcessAffinity(
        cpus=topology.online_cpus - {0, 8}, mems=frozenset({0, 1}), source="cpuset"
    )
    exclusive = in_mode("exclusive", topology, affinity=allowed)
    core_complex = in_mode("core-complex", topology, affinity=allowed)
    assert [p.cpus for p in exclusive[:2]] == [{1, 2, 9, 10}, {3, 11}]
    assert [p.cpus for p in core_complex[:2]] == [{1, 9}, {2, 3, 10, 11}]


def test_a_node_with_more_gpus_than_l3_groups_wraps_round_and_says_so(tmp_path):
    host = dataclasses.replace(
        L3_HOST.host(),
        pci=[fakesys.PciSpec(fakesys.gpu_address(i), 0) for i in range(3)],
    )
    placements = in_mode("core-complex", sysfs(tmp_path, host), tp_size=3)
    assert [p.cpus for p in placements] == [L3_SHARES[0], L3_SHARES[1], L3_SHARES[0]]
    assert "node 0 has 3 GPUs for 2 L3 groups: GPUs wrap round and share a group" in (
        placements[2].reasons
    )
    assert not placements[2].degraded


def test_exclusive_with_more_gpus_than_cores_splits_siblings_then_shares(tmp_path):
    shape = fakesys.Shape(
        sockets=2, cores_per_node=2, threads_per_core=2, gpus_per_node=3
    )
    placements = in_mode("exclusive", sysfs(tmp_path, shape), tp_size=3)
    # node 0: cores {0, 4} and {1, 5}, as threads in core order 0, 4, 1, 5: 2 + 1 + 1.
    assert [p.cpus for p in placements] == [{0, 4}, {1}, {5}]
    assert "slices split SMT siblings" in " ".join(placements[0].reasons)
    assert not any(p.degraded for p in placements)

    crowded = fakesys.Shape(sockets=2, cores_per_node=1, gpus_per_node=3)
    placements = in_mode("exclusive", sysfs(tmp_path / "2", crowded), tp_size=3)
    assert [p.cpus for p in placements] == [{0}] * 3
    assert all(p.degraded for p in placements)
    assert "node 0 has 1 allowed CPUs for 3 GPUs: GPUs share CPUs" in (
        placements[2].reasons
    )


def test_core_complex_without_l3_groups_binds_the_whole_node_with_a_warning(tmp_path):
    shape = dataclasses.replace(L3_HOST, l3_per_node=0)  # a VM: no cache/index3
    placements = in_mode("core-complex", sysfs(tmp_path, shape))
    assert placements[0].cpus == L3_SHARES[0] | L3_SHARES[1]
    assert placements[0].numactl_args == ("--cpunodebind=0", "--membind=0")
    assert placements[0].degraded
    assert any("sysfs has no L3 groups" in r for r in placements[0].reasons)


@pytest.mark.parametrize("mode", ["exclusive", "core-complex"])
def test_a_gpu_not_among_its_nodes_devices_binds_the_whole_node(tmp_path, mode):
    """--numa-node puts GPU 0 on node 1, whose devices sysfs lists without it."""
    placements = in_mode(mode, sysfs(tmp_path, L3_HOST), numa_node=[1, 0, 1, 1])
    assert placements[0].numa_node == 1
    assert placements[0].cpus == L3_SHARES[2] | L3_SHARES[3]
    assert placements[0].degraded
    assert (
        f"{mode} mode: GPU 0000:18:00.0 is not among node 1's cuda devices in sysfs "
        "(0000:38:00.0, 0000:48:00.0): bound to the whole node"
    ) in placements[0].reasons
