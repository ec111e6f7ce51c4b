"""plan_node(): a Ray node's ranks resolved together from explicit accelerator ids, on fake sysfs trees (no Ray)."""

from __future__ import annotations

import pytest

import fakesys
from sglang.srt.environ import envs
from sglang.srt.placement.devices import DeviceIdentityError
from sglang.srt.placement.numactl import NumactlProber, ProbeResult
from sglang.srt.placement.resolve import (
    HostCapabilities,
    PlacementIntent,
    PlacementPolicy,
    local_ranks,
    placement_intent,
    plan_node,
)
from sglang.srt.placement.topology import read_topology
from sglang.srt.placement.types import Accelerator, ProcessAffinity
from sglang.srt.scheduler_rank.ray_plan import Candidate, RankPlan
from sglang.srt.placement.engine_args import EngineArgs

GPUS = [fakesys.gpu_address(i) for i in range(4)]


class Counting:
    """A numactl prober whose kernel accepts everything, recording each option set it probes."""

    def __init__(self):
        self.calls = []
        self.prober = NumactlProber(numactl_path="/usr/bin/numactl", run=self._run)

    def _run(self, argv):
        self.calls.append(tuple(argv[1:-1]))
        return ProbeResult(ok=True, message="")


def host(tree):
    topology = read_topology(tree)
    affinity = ProcessAffinity(cpus=topology.online_cpus, mems=frozenset(n.node_id for n in topology.nodes),
                               source="the tree")
    return dict(topology=topology, affinity=affinity)


@pytest.fixture
def two_sockets(tmp_path):
    """Nodes 0 and 1; GPUs 0000:18:00.0 and 0000:28:00.0 on node 0, 0000:38:00.0 and 0000:48:00.0 on node 1."""
    return host(fakesys.two_sockets_four_gpus(tmp_path / "sys"))


@pytest.fixture
def one_node_eight_cpus(tmp_path):
    """Node 0 with CPUs 0-7 and all four GPUs; node 1 with CPUs 8-11 and none."""
    return host(fakesys.write_sysfs(tmp_path / "sys", fakesys.Host(
        nodes={0: fakesys.NodeSpec(cpus=range(8)), 1: fakesys.NodeSpec(cpus=range(8, 12))},
        pci=[fakesys.host_bridge(0)] + [fakesys.PciSpec(a, 0) for a in GPUS],
    )))


def plan(facts, ranks_with_ids, *, counting=None, **server):
    counting = counting or Counting()
    return plan_node(EngineArgs(**server), ranks_with_ids=ranks_with_ids, runtime=None,
                     capabilities=HostCapabilities(numactl=counting.prober, libnuma=True), **facts)


def test_each_rank_is_identified_from_its_own_id_not_from_the_callers_visible_devices(two_sockets, monkeypatch):
    # A Ray task holding GPU 3 sees CUDA_VISIBLE_DEVICES=3: it must not decide its neighbours' devices.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    ranks = local_ranks(EngineArgs(tp_size=4))
    placements = plan(two_sockets, [(r, str(i)) for i, r in enumerate(ranks)], tp_size=4)
    assert [p.pci for p in placements] == GPUS
    assert [p.numa_node for p in placements] == [0, 0, 1, 1]
    assert [p.gpu_id for p in placements] == [0, 1, 2, 3]
    assert placements[3].numactl_args == ("--cpunodebind=1", "--membind=1")
    assert all(p.launcher == "ray" and p.strategy == "exec" for p in placements)
    assert "Ray GPU id '3'" in placements[3].reasons[0]


def test_dp2_tp2_ranks_take_the_ids_they_are_given_whatever_their_order(two_sockets):
    ranks = local_ranks(EngineArgs(tp_size=2, dp_size=2))
    placements = plan(two_sockets, list(zip(ranks, ["3", "2", "1", "0"])), tp_size=2, dp_size=2)
    assert [(p.dp_rank, p.tp_rank, p.gpu_id) for p in placements] == [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]
    assert [p.pci for p in placements] == GPUS[::-1]
    assert [p.numa_node for p in placements] == [1, 1, 0, 0]


def test_exclusive_mode_gives_the_nodes_ranks_disjoint_slices(one_node_eight_cpus):
    ranks = local_ranks(EngineArgs(tp_size=4))
    with envs.SGLANG_NUMA_AFFINITY_MODE.override("exclusive"):
        placements = plan(one_node_eight_cpus, [(r, str(i)) for i, r in enumerate(ranks)], tp_size=4)
    assert [p.cpus for p in placements] == [frozenset({0, 1}), frozenset({2, 3}), frozenset({4, 5}),
                                            frozenset({6, 7})]
    assert placements[1].numactl_args == ("--physcpubind=2-3", "--membind=0")


def rank_plans(ranks, placements, ids):
    it = iter(placements)
    return [RankPlan(rank=r, bundle_index=0, candidates=tuple(Candidate(accelerator_id=i, placement=next(it))
                                                                 for i in ids)) for r in ranks]


def test_candidates_of_one_bundle_agree_in_node_mode_and_differ_by_slice_in_exclusive_mode(one_node_eight_cpus):
    ranks = local_ranks(EngineArgs(tp_size=2))
    pairs = [(r, gpu) for r in ranks for gpu in ("0", "1")]
    node_mode = plan(one_node_eight_cpus, pairs, tp_size=2)
    assert [p.pci for p in node_mode] == [GPUS[0], GPUS[1]] * 2
    assert all(rp.agreed for rp in rank_plans(ranks, node_mode, ("0", "1")))
    with envs.SGLANG_NUMA_AFFINITY_MODE.override("exclusive"):
        exclusive = plan(one_node_eight_cpus, pairs, tp_size=2)
    # Slices go by device: whichever rank gets GPU 0 takes CPUs 0-3, GPU 1's rank CPUs 4-7.
    assert [p.cpus for p in exclusive] == [frozenset(range(4)), frozenset(range(4, 8))] * 2
    assert not any(rp.agreed for rp in rank_plans(ranks, exclusive, ("0", "1")))


def test_candidates_on_different_numa_nodes_do_not_agree(two_sockets):
    (rank,) = local_ranks(EngineArgs(tp_size=1))
    placements = plan(two_sockets, [(rank, "1"), (rank, "2")], tp_size=1)
    assert [p.numa_node for p in placements] == [0, 1]
    assert not rank_plans([rank], placements, ("1", "2"))[0].agreed


def test_a_gpu_rank_without_an_id_is_an_error_naming_it(two_sockets):
    ranks = local_ranks(EngineArgs(tp_size=2))
    with pytest.raises(DeviceIdentityError, match=r"DP0 PP0 TP1: no accelerator id was given .*\{'GPU': 1\}"):
        plan(two_sockets, [(ranks[0], "0"), (ranks[1], None)], tp_size=2)


def test_gpus_option_names_the_device_of_each_physical_id(two_sockets):
    (rank,) = local_ranks(EngineArgs(tp_size=1))
    (p,) = plan_node(EngineArgs(tp_size=1), ranks_with_ids=[(rank, "1")], gpus=[GPUS[3], GPUS[0]], runtime=None,
                     capabilities=HostCapabilities(numactl=Counting().prober, libnuma=True), **two_sockets)
    assert p.pci == GPUS[0] and p.numa_node == 0


def test_each_distinct_option_set_is_probed_once_and_the_intent_probes_nothing(two_sockets):
    counting = Counting()
    ranks = local_ranks(EngineArgs(tp_size=4))
    plan(two_sockets, [(r, str(i)) for i, r in enumerate(ranks)], counting=counting, tp_size=4)
    assert sorted(counting.calls) == [("--cpunodebind=0", "--membind=0"), ("--cpunodebind=1", "--membind=1")]

    # The intent alone (node, CPUs, memory) asks the host nothing: the numactl probe belongs to choose_strategy.
    policy = PlacementPolicy(launcher="ray", device="cuda")
    intent = placement_intent(rank=ranks[2], accelerator=Accelerator(2, "2", GPUS[2], "test"), policy=policy,
                              **two_sockets)
    assert isinstance(intent, PlacementIntent)
    assert (intent.node_id, intent.cpus, intent.mem_nodes, intent.whole_nodes) == (
        1, two_sockets["topology"].node(1).cpus, (1,), (1,))
    assert len(counting.calls) == 2
