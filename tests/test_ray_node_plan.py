"""A Ray node's plan for its bundles' GPU ids (``ray_plan.plan_ids``), on fake sysfs trees, without Ray.

The numactl here is a stand-in that accepts every option: the trees describe
NUMA nodes this host does not have.
"""

from __future__ import annotations

import fakesys
import pytest

from sglang.srt.placement.numactl import NumactlProber, ProbeResult
from sglang.srt.placement.plan import HostFacts
from sglang.srt.placement_tools.plan_args import PlanArgs
from sglang.srt.placement.policy import PlacementPolicy
from sglang.srt.placement.strategy import HostCapabilities
from sglang.srt.placement.topology import read_topology
from sglang.srt.placement.types import ProcessAffinity
from sglang.srt.scheduler_placement.ray_plan import plan_ids

GPUS = [fakesys.gpu_address(i) for i in range(4)]


def accepting() -> NumactlProber:
    return NumactlProber(
        numactl_path="/usr/bin/numactl",
        run=lambda argv: ProbeResult(ok=True, message=""),
    )


def facts(tree) -> HostFacts:
    topology = read_topology(tree)
    affinity = ProcessAffinity(
        cpus=topology.online_cpus,
        mems=frozenset(n.node_id for n in topology.nodes),
        source="the tree",
    )
    capabilities = HostCapabilities(numactl=accepting(), libnuma=True)
    return HostFacts(topology=topology, affinity=affinity, capabilities=capabilities)


@pytest.fixture
def two_sockets(tmp_path) -> HostFacts:
    """GPUs 0 and 1 on node 0 (CPUs 0-7 of a 2 x 8-core host), GPUs 2 and 3 on node 1."""
    return facts(fakesys.two_sockets_four_gpus(tmp_path / "sys"))


@pytest.fixture
def one_node_eight_cpus(tmp_path) -> HostFacts:
    """Node 0 with CPUs 0-7 and all four GPUs; node 1 with CPUs 8-11 and none."""
    return facts(
        fakesys.write_sysfs(
            tmp_path / "sys",
            fakesys.Host(
                nodes={
                    0: fakesys.NodeSpec(cpus=range(8)),
                    1: fakesys.NodeSpec(cpus=range(8, 12)),
                },
                pci=[fakesys.host_bridge(0)] + [fakesys.PciSpec(a, 0) for a in GPUS],
            ),
        )
    )


def plan(host: HostFacts, ids, **args):
    server_args = PlanArgs(**args)
    policy = PlacementPolicy.from_env(server_args, launcher="ray")
    return plan_ids(server_args, ids, policy=policy, facts=host)


def test_each_id_is_placed_as_the_device_ray_names_whatever_this_process_sees(
    two_sockets, monkeypatch
):
    # A task holding GPU 3 sees CUDA_VISIBLE_DEVICES=3: it must not decide the other ids' devices.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    placements = plan(two_sockets, ["3", "2", "1", "0"], tp_size=4)
    assert [p.pci for p in placements] == GPUS[::-1]
    assert [p.rank.gpu_id for p in placements] == [3, 2, 1, 0]  # the id sglang's actor uses
    assert [p.numa_node for p in placements] == [1, 1, 0, 0]
    assert placements[0].numactl_args == ("--cpunodebind=1", "--membind=1")
    assert all(p.launcher == "ray" and p.strategy == "exec" for p in placements)


def test_exclusive_mode_slices_the_node_between_every_id_of_its_bundles(
    one_node_eight_cpus, monkeypatch
):
    monkeypatch.setenv("SGLANG_NUMA_AFFINITY_MODE", "exclusive")
    placements = plan(one_node_eight_cpus, ["0", "1", "2", "3"], tp_size=4)
    assert [p.cpus for p in placements] == [
        frozenset({0, 1}),
        frozenset({2, 3}),
        frozenset({4, 5}),
        frozenset({6, 7}),
    ]
    assert placements[1].numactl_args == ("--physcpubind=2-3", "--membind=0")


def test_numa_node_is_indexed_by_the_gpu_id_the_actor_uses(two_sockets):
    placements = plan(two_sockets, ["2", "0"], tp_size=2, numa_node=[1, 1, 0, 0])
    assert [p.numa_node for p in placements] == [0, 1]
    assert "node 0 from --numa-node (GPU 2)" in placements[0].reasons


def test_a_setting_that_does_not_fit_one_id_fails_only_that_id(
    one_node_eight_cpus, monkeypatch
):
    monkeypatch.setenv("SGLANG_NUMA_AFFINITY_MODE", "exclusive")
    # --numa-node has no entry for GPU 3: the rank that gets it fails; the others keep
    # their slice of the node, cut among its four GPUs.
    placements = plan(
        one_node_eight_cpus, ["0", "1", "2", "3"], tp_size=4, numa_node=[0, 0, 0]
    )
    *good, missing = placements
    assert isinstance(missing, str) and "--numa-node has 3 entries" in missing
    assert "uses GPU 3: give one node per GPU id, at least 4 entries" in missing
    assert [p.cpus for p in good] == [
        frozenset({0, 1}),
        frozenset({2, 3}),
        frozenset({4, 5}),
    ]


def test_cpu_device_ids_are_placed_by_the_numa_index_bootstrap_will_use(
    two_sockets, monkeypatch
):
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "8-11|0-3")
    placements = plan(two_sockets, ["1", "0", "2"], tp_size=2, device="cpu")
    assert [p.cpus for p in placements[:2]] == [
        frozenset(range(4)),
        frozenset(range(8, 12)),
    ]
    assert [p.rank.gpu_id for p in placements[:2]] == [1, 0]
    # Index 2 has no group: only the rank that gets Ray's GPU 2 fails, naming the setting.
    assert isinstance(placements[2], str)
    assert "SGLANG_CPU_OMP_THREADS_BIND='8-11|0-3' has 2 group(s)" in placements[2]


def test_an_id_that_is_not_an_index_fails_that_id(two_sockets):
    placements = plan(two_sockets, ["GPU-5d3f", "1"], tp_size=2)
    assert "'GPU-5d3f' is not an integer" in placements[0]
    assert placements[1].pci == GPUS[1]
