"""The decision (resolve_placement) on hosts given as facts, the conflict rule between
the settings, and the rank arithmetic and settings it reads."""

from __future__ import annotations

import os

import pytest

from sglang.srt.environ import envs
from sglang.srt.placement import settings
from sglang.srt.placement.facts import FactsHost
from sglang.srt.placement.resolve import resolve_placement
from sglang.srt.placement.settings import PlacementPolicy, SettingError
from sglang.srt.placement.share import upstream_slice
from sglang.srt.placement.types import (
    Cpu,
    DeviceIndex,
    DeviceRef,
    HostTopology,
    NumaNode,
    PciDevice,
    ProcessAffinity,
    RankIdentity,
)
from sglang.srt.placement_tools import PlanArgs as EngineArgs
from sglang.srt.placement_tools import UsageError as EngineArgsError
from sglang.srt.placement_tools.engine import from_dict, local_ranks, to_dict

GPUS = ("0000:17:00.0", "0000:31:00.0", "0000:b1:00.0", "0000:ca:00.0")


def make_topology(nodes, *, pci=(), smt=1):
    """nodes: {node_id: (cpu ids, memory_kb)}; pci: [(address, numa_node or None)]; smt:
    threads per core (siblings are c and c + half of the node's CPUs, as x86 numbers them).
    """
    numa_nodes, cpus = [], []
    for node_id, (cpu_ids, mem) in sorted(nodes.items()):
        cpu_ids = sorted(cpu_ids)
        numa_nodes.append(NumaNode(node_id, frozenset(cpu_ids), mem))
        half = len(cpu_ids) // smt if smt > 1 else len(cpu_ids)
        for i, c in enumerate(cpu_ids):
            core = i % half if half else 0
            siblings = frozenset(
                cpu_ids[j] for j in range(len(cpu_ids)) if j % half == core
            )
            cpus.append(Cpu(c, node_id, node_id, core, siblings))
    devices = tuple(
        PciDevice(address, node, vendor="0x10de", pci_class="0x030200")
        for address, node in pci
    )
    online = frozenset(c.cpu_id for c in cpus)
    return HostTopology("/fake/sys", tuple(numa_nodes), tuple(cpus), online, devices)


def two_sockets(smt=2):
    """Nodes 0 and 1 of 8 CPUs (4 cores x 2 threads), two GPUs each."""
    return make_topology(
        {0: (range(8), 1 << 24), 1: (range(8, 16), 1 << 24)},
        pci=[(pci, i // 2) for i, pci in enumerate(GPUS)],
        smt=smt,
    )


class Host(FactsHost):
    """A host as facts, whose numactl refuses the option sets in ``refuse``."""

    def __init__(self, topology, *, cpus=None, refuse=(), numactl="numactl", **kw):
        allowed = frozenset(cpus) if cpus is not None else topology.online_cpus
        mems = frozenset(n.node_id for n in topology.nodes if n.has_memory)
        kw.setdefault("env", {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
        super().__init__(
            topology=topology, affinity=ProcessAffinity(allowed, mems, "test"), **kw
        )
        self.refuse, self.probed, self.failures = refuse, [], []
        self.numactl_path = numactl

    def probe(self, numactl_args):
        self.probed.append(numactl_args)
        ladder = [numactl_args, numactl_args.replace("--membind=", "--preferred=")]
        ladder.append(" ".join(w for w in numactl_args.split() if "mem" not in w))
        for args in ladder:
            if not any(word in args for word in self.refuse):
                return args, ""
        return None, "numactl: refused"

    def fail(self, node, reason):
        self.failures.append(reason)


def place(host, index=0, *, launcher="mp", cpu=False, **policy):
    numbering = DeviceIndex.CPU_RANK if cpu else DeviceIndex.LOGICAL_GPU
    rank = RankIdentity(DeviceRef(numbering, index), 0, 0, index)
    policy = PlacementPolicy(
        launcher=launcher, device="cpu" if cpu else "cuda", **policy
    )
    return resolve_placement(rank=rank, policy=policy, host=host)


# --- a GPU's node ---------------------------------------------------------------------


def test_each_gpu_binds_to_its_node_under_numactl():
    host = Host(two_sockets())
    placements = [place(host, i) for i in range(4)]
    assert [p.numa_node for p in placements] == [0, 0, 1, 1]
    assert placements[2].numactl_args == ("--cpunodebind=1", "--membind=1")
    assert placements[2].cpus == frozenset(range(8, 16)) and not placements[2].degraded
    assert placements[2].numactl_path == "numactl"


def test_cuda_visible_devices_reordered():
    host = Host(two_sockets(), env={"CUDA_VISIBLE_DEVICES": "3,0"})
    assert [place(host, i).pci for i in (0, 1)] == [GPUS[3], GPUS[0]]


def test_one_node_host_binds_nothing_and_says_why():
    host = Host(make_topology({0: (range(4), 1 << 20)}, pci=[(GPUS[0], 0)]))
    placement = place(host)
    assert not placement.bound and "one NUMA node" in placement.reasons[0]


def test_a_gpu_the_kernel_cannot_place_is_unbound_with_the_reason():
    topology = make_topology(
        {0: (range(4), 1), 1: (range(4, 8), 1)}, pci=[(GPUS[0], None)]
    )
    placement = place(Host(topology))
    assert not placement.bound and "numa_node -1" in placement.reasons[-1]


def test_numa_node_list_wins_and_is_checked_once():
    host = Host(two_sockets(), numa_nodes=[1, 0])
    assert place(host, 0, numa_nodes=(1, 0)).numa_node == 1
    with pytest.raises(SettingError, match="--numa-node has 2 entries"):
        place(host, 2, numa_nodes=(1, 0))


def test_a_listed_node_the_host_lacks_fails_naming_it():
    host = Host(two_sockets(), numa_nodes=[5])
    placement = place(host, 0, numa_nodes=(5,))
    assert not placement.bound and placement.degraded
    assert "NUMA node 5 does not exist on this host (nodes 0-1)" in host.failures[0]


def test_a_cpuset_leaving_part_of_the_node_binds_those_cpus_and_none_fails():
    host = Host(two_sockets(), cpus={0, 1, 2})
    assert place(host, 0).numactl_args == ("--physcpubind=0,1,2", "--membind=0")
    placement = place(host, 2)
    assert not placement.bound and placement.degraded
    assert "NUMA node 1 has no CPU cores allowed" in host.failures[0]


def test_a_node_without_cpus_is_left_to_numactl_which_refuses_it():
    topology = make_topology(
        {0: (range(4), 1), 1: (range(4, 8), 1), 2: ((), 1 << 20)},
        pci=[(GPUS[0], 2)],
    )
    host = Host(topology, refuse=("--cpunodebind=2",))
    placement = place(host)
    assert host.probed == ["--cpunodebind=2 --membind=2"] and not placement.bound
    assert "numactl could not apply NUMA binding for node 2" in host.failures[0]


# --- the memory policy and how it is applied ------------------------------------------


def test_a_refused_membind_falls_back_to_preferred_and_is_degraded():
    host = Host(two_sockets(), refuse=("--membind",))
    placement = place(host, 2)
    assert placement.numactl_args == ("--cpunodebind=1", "--preferred=1")
    assert (placement.mem_policy, placement.degraded) == ("preferred", True)


def test_numactl_refusing_everything_leaves_the_spawn_unbound():
    host = Host(two_sockets(), refuse=("--cpunodebind",))
    placement = place(host, 2)
    assert not placement.bound and placement.degraded
    assert "numactl: refused; skipping NUMA binding for DP0 PP0 TP2" in host.failures[0]


def test_without_numactl_the_reason_says_so():
    host = Host(two_sockets(), refuse=("--cpunodebind",), numactl=None)
    place(host, 2)
    assert "numactl is not installed (apt-get install numactl)" in host.failures[0]


def test_without_mempolicy_only_the_cpus_are_bound():
    host = Host(two_sockets())
    host.can_set_mempolicy = lambda: False
    placement = place(host, 2)
    assert placement.numactl_args == ("--cpunodebind=1",)
    assert placement.mem_policy == "none" and "SYS_NICE" in placement.reasons[-2]


def test_a_ray_actor_binds_itself_strictly_and_a_legacy_rank_prefers():
    host = Host(two_sockets())
    ray = place(host, 2, launcher="ray")
    assert (ray.strategy, ray.mem_policy, ray.numactl_args) == (
        "in-process",
        "bind",
        (),
    )
    assert host.probed == []
    v1 = place(host, 2, bind_v2=False)
    assert (v1.strategy, v1.mem_policy, v1.mem_nodes) == ("v1", "preferred", {1})


def test_a_ray_actor_without_libnuma_binds_cpus_only():
    host = Host(two_sockets())
    host.libnuma = False
    placement = place(host, 2, launcher="ray")
    assert placement.mem_policy == "none" and "libnuma" in placement.reasons[-1]


# --- SGLANG_SET_CPU_AFFINITY ------------------------------------------------------------


def test_set_cpu_affinity_slices_each_node_keeping_smt_siblings_together():
    host = Host(two_sockets())
    slices = [place(host, i, set_cpu_affinity=True).cpus for i in range(4)]
    assert slices == [{0, 1, 4, 5}, {2, 3, 6, 7}, {8, 9, 12, 13}, {10, 11, 14, 15}]
    assert "GPU 0000:31:00.0, 2 of the 2 GPUs on node 0" in " ".join(
        place(host, 1, set_cpu_affinity=True).reasons
    )


def test_set_cpu_affinity_slices_unevenly_when_cores_do_not_divide():
    topology = make_topology(
        {0: (range(5), 1), 1: (range(5, 10), 1)}, pci=[(GPUS[0], 0), (GPUS[1], 0)]
    )
    host = Host(topology)
    assert [place(host, i, set_cpu_affinity=True).cpus for i in (0, 1)] == [
        {0, 1, 2},
        {3, 4},
    ]


def test_more_gpus_than_cores_split_siblings_then_share_and_say_so():
    topology = make_topology(
        {0: (range(2), 1), 1: (range(2, 4), 1)},
        pci=[(pci, 0) for pci in GPUS[:3]],
        smt=2,
    )
    host = Host(topology)
    shares = [place(host, i, set_cpu_affinity=True) for i in range(3)]
    assert [p.cpus for p in shares] == [{0}, {1}, {0}]
    assert shares[2].degraded and "GPUs share CPUs" in shares[2].reasons[-2]


def test_numa_node_picks_the_node_and_set_cpu_affinity_the_slice_within_it():
    host = Host(two_sockets(), numa_nodes=[1, 1, 0, 0])
    placement = place(host, 1, numa_nodes=(1, 1, 0, 0), set_cpu_affinity=True)
    assert (placement.numa_node, placement.cpus) == (1, {10, 11, 14, 15})
    assert "one of GPUs 0-1 on node 1 by --numa-node" in " ".join(placement.reasons)


def test_a_gpu_not_among_its_nodes_gpus_takes_the_whole_node_with_a_warning():
    # NVML's memory affinity put the GPU on a node whose sysfs devices do not list it.
    host = Host(two_sockets())
    host.node_gpus = lambda node: ()
    placement = place(host, 2, set_cpu_affinity=True)
    assert placement.cpus == frozenset(range(8, 16)) and placement.degraded
    assert "is not among node 1's GPUs in sysfs (none)" in host.failures[0]


def test_without_a_node_set_cpu_affinity_keeps_upstreams_slice():
    host = Host(make_topology({0: (range(8), 1)}, smt=2, pci=[(GPUS[0], 0)]))
    placement = place(host, 3, set_cpu_affinity=True, tp_per_node=2)
    # 4 physical cores / 2 per node: GPU 3 gets cores 2-3 and their siblings 6-7.
    assert (placement.strategy, placement.cpus) == ("cpu-affinity", {2, 3, 6, 7})
    assert "NUMA-blind" in placement.reasons[-1]


def test_upstream_slice_is_set_gpu_proc_affinitys_rule():
    # dp2 x tp4 on 8 GPUs and 112 cores (2 x 28, SMT): GPU 4 gets cores 0-27.
    cpus = upstream_slice(4, tp_per_node=4, physical_cores=56, logical_cpus=112)
    assert cpus == frozenset(range(0, 14)) | frozenset(range(56, 70))
    assert upstream_slice(2, tp_per_node=2, physical_cores=4, logical_cpus=4) == {0, 1}


# --- CPU-device ranks ----------------------------------------------------------------------


def test_cpu_ranks_get_their_group_and_its_nodes_memory():
    host = Host(two_sockets())
    placement = place(host, 1, cpu=True, cpu_threads_bind="0-3|6-9")
    assert placement.numactl_args == ("--physcpubind=6,7,8,9", "--membind=0,1")
    assert placement.numa_node == 0  # 2 of its CPUs on node 0, 2 on 1: the lower


def test_cpu_ranks_with_all_take_one_node_each_and_whole():
    host = Host(two_sockets())
    placement = place(host, 1, cpu=True)
    assert placement.numactl_args == ("--cpunodebind=1", "--membind=1")


def test_cpu_ranks_are_unbound_as_upstream_leaves_them_with_bind_v2_off():
    host = Host(two_sockets())
    placement = place(host, 1, cpu=True, bind_v2=False)
    assert not placement.bound and "SGLANG_NUMA_BIND_V2=0" in placement.reasons[-1]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("0-3", r"has 1 group\(s\) but rank index 1 needs one more"),
        ("0-3|x", "is not a cpulist"),
        ("0-3|64", "not online on this host"),
    ],
)
def test_cpu_threads_bind_errors_name_the_setting(spec, message):
    with pytest.raises(SettingError, match=message):
        place(Host(two_sockets()), 1, cpu=True, cpu_threads_bind=spec)


# --- records, rank arithmetic and settings ---------------------------------------------


def test_placement_json_round_trip():
    placement = place(Host(two_sockets()), 2, set_cpu_affinity=True)
    assert from_dict(to_dict(placement)) == placement


def test_engine_and_data_parallel_formulas_give_upstreams_gpu_ids():
    ranks = local_ranks(EngineArgs(tp_size=2, pp_size=2, base_gpu_id=1, gpu_id_step=2))
    assert [(r.pp_rank, r.tp_rank, r.device.index) for r in ranks] == [
        (0, 0, 1),
        (0, 1, 3),
        (1, 0, 3),
        (1, 1, 5),
    ]
    dp = local_ranks(EngineArgs(tp_size=2, dp_size=2, gpu_id_step=2, base_gpu_id=1))
    assert [r.device.index for r in dp] == [1, 3, 5, 7]
    assert local_ranks(EngineArgs(device="cpu"))[0].device.numbering == "cpu-rank"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tp_size=0), r"--tp-size=0 is not valid: it must be a positive integer"),
        (dict(nnodes=2, node_rank=2), r"--node-rank=2 is not valid with --nnodes=2"),
        (dict(device="npu"), r"--device='npu' is not supported here"),
        (dict(numa_node=[0, -1]), r"--numa-node contains -1"),
    ],
)
def test_server_args_errors(kwargs, message):
    with pytest.raises(EngineArgsError, match=message):
        EngineArgs(**kwargs)


def test_settings_defaults_and_a_malformed_boolean_keeps_upstreams_default():
    os.environ.pop("SGLANG_SET_CPU_AFFINITY", None)
    assert settings.set_cpu_affinity() is False and settings.bind_v2() is True
    with envs.SGLANG_SET_CPU_AFFINITY.override("maybe"), pytest.warns(
        UserWarning, match="Invalid value for SGLANG_SET_CPU_AFFINITY"
    ):
        assert settings.set_cpu_affinity() is False
    with envs.SGLANG_CPU_OMP_THREADS_BIND.override(" "):
        with pytest.raises(SettingError, match="SGLANG_CPU_OMP_THREADS_BIND is empty"):
            settings.cpu_threads_bind()


def test_policy_rejects_an_unknown_launcher_and_labels_ranks():
    with pytest.raises(ValueError, match="launcher 'slurm' is not one of mp, ray"):
        PlacementPolicy(launcher="slurm", device="cuda")
    assert RankIdentity(None, 1, 0, 3).label == "DP1 PP0 TP3"
    gpu = DeviceRef(DeviceIndex.PHYSICAL_GPU, 5)
    assert RankIdentity(gpu).label == "Ray GPU 5"
