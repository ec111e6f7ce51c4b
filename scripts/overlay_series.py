"""The overlay as a patch series for review: one idea per patch, in an order where each builds on the last.

``overlay.py --series OUT CHECKOUT`` (a pristine sglang checkout: ``python/sglang``
and ``test/``, left untouched) writes ``OUT/series`` (the patch names in order)
and ``OUT/NNNN-<slug>.patch``. Each patch is a short header (``Subject:``, what
and why, the tests it adds, what an operator notices) and a unified diff with
paths relative to the checkout, so ``git apply -p1`` at its root applies them in
order, and after the last the checkout is what ``overlay.py CHECKOUT`` makes.
``--series OUT PACKAGE_DIR`` writes the same series for a package dir (paths
``sglang/...``, applied from its parent) without the test files: a package has
no ``test/``.

``SERIES`` names every file by its path in a checkout. Each file belongs to
exactly one patch, at its final content, except that ``Partial`` states may come
first. Every patch that changes ``python/`` adds tests in upstream's layout
(``test/registered/<area>/test_*.py``: ``unittest``, ``register_cpu_ci``), says
what an operator notices, and changes at most ``MAX_CHANGED_LINES`` lines, its
tests included; the series is refused (naming the patch) otherwise.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import (
    Any,
    Callable,
    Dict,
    FrozenSet,
    Iterable,
    List,
    NamedTuple,
    Optional,
    Sequence,
    Set,
    Tuple,
    Union,
)

MAX_CHANGED_LINES = 800


class Span(NamedTuple):
    """The text from ``first`` through the next ``last``: a swap names a block by its
    ends rather than repeating the module's code."""

    first: str
    last: str


@dataclass(frozen=True)
class Partial:
    """An intermediate state of a file, which a later patch brings to its final content.

    Either ``keep``, for a new file (a module or a test): the top-level names its
    state defines at least; what they use comes along. Or edits of upstream's
    module, the rest of which stays as upstream has it: ``replace``,
    ``add_before``, ``remove`` and ``imports``. Either may ``swap`` texts.
    """

    path: str
    keep: Tuple[str, ...] = ()
    replace: Tuple[str, ...] = ()
    """Definitions taken from the final module in place of upstream's."""
    add_before: Dict[str, Tuple[str, ...]] = field(default_factory=dict)
    """name -> definitions of the final module inserted before it (names upstream lacks)."""
    remove: Tuple[str, ...] = ()
    imports: Tuple[str, ...] = ()
    """``from X import ...`` lines: each replaces upstream's import from X, or is added where isort puts it."""
    swap: Tuple[Tuple[Union[str, Span], str], ...] = ()
    """(old, new) texts, each old found once: in the final new file before it is cut
    to ``keep`` (a command line without its later subcommands), or in the edited
    upstream module (a dispatch kept for a path a later patch replaces)."""


@dataclass(frozen=True)
class Patch:
    slug: str
    title: str
    why: str
    operators: str
    """What an operator notices once this patch is in: never "Nothing yet"."""
    files: Tuple[str, ...] = ()
    """Checkout paths (python/sglang/..., test/registered/...) this patch brings to their final content."""
    partial: Tuple[Partial, ...] = ()
    fixes: str = ""
    """The known bug this patch fixes (a key of ``BUGS``), if any."""


#: The known bugs; tests/test_series.py holds each fix within the series' first 1500
#: changed lines.
BUGS = {
    "ray": "Ray scheduler actors unbound, or bound to the wrong node on nodes with several GPUs",
    "shm": "co-located CPU engines colliding on /dev/shm, and leaving segments behind",
}

PY = "python/sglang/"
TEST = "test/"
P = PY + "srt/placement/"
G = PY + "srt/scheduler_placement/"
D = PY + "srt/distributed/"
T = PY + "srt/placement_tools/"
NUMA = PY + "srt/utils/numa_utils.py"
UT = TEST + "registered/utils/"
PT = TEST + "registered/placement/"
DT = TEST + "registered/distributed/"
RT = TEST + "registered/ray/"
TT = TEST + "registered/placement_tools/"

#: numa_utils in steps: each state is upstream's module with these definitions
#: taken from the final one (the rest as upstream has it).
NUMA_NODES = Partial(
    NUMA,
    replace=("_node_cpus", "_is_numa_available"),
    add_before={"_node_cpus": ("__getattr__", "_platform_flag", "_host_topology")},
    remove=("_Bitmask",),
    imports=(
        "from typing import Any, Optional",
        "from sglang.srt.placement import settings",
    ),
)
NUMA_DISCOVERY = dataclasses.replace(
    NUMA_NODES,
    replace=NUMA_NODES.replace + ("_query_numa_node_for_gpu",),
    swap=(  # XPU keeps upstream's path until the next patch
        (
            """    device = (
        "xpu"
        if _platform_flag("_is_xpu") and not _platform_flag("_is_cuda")
        else "cuda"
    )
""",
            """    if _platform_flag("_is_xpu") and not _platform_flag("_is_cuda"):
        return _query_numa_node_for_xpu(device_id)
    device = "cuda"
""",
        ),
    ),
)
NUMA_XPU = dataclasses.replace(
    NUMA_DISCOVERY,
    remove=NUMA_NODES.remove
    + (
        "_list_xpu_pci_addresses",
        "_is_integrated_xpu",
        "_xpu_pci_sort_key",
        "_xpu_visible_device_indices",
        "_xpu_visible_pci_addresses",
        "_xpu_pci_address",
        "_read_pci_numa_node",
        "_query_numa_node_for_xpu",
    ),
    swap=(),
)
NUMA_BIND = dataclasses.replace(
    NUMA_XPU,
    replace=NUMA_XPU.replace
    + (
        "get_libnuma",
        "numa_bind_to_node",
        "_handle_numa_bind_failure",
        "_can_set_mempolicy",
        "get_numa_node_if_available",
    ),
    add_before={"_node_cpus": NUMA_XPU.add_before["_node_cpus"] + ("_node_exists",)},
)
NUMA_CPU = dataclasses.replace(  # init_threads_binding where the final module has it
    NUMA_BIND,
    replace=NUMA_BIND.replace + ("_log_cpu_only_binding",),
    add_before={
        **NUMA_BIND.add_before,
        "_log_cpu_only_binding": ("init_threads_binding",),
    },
    remove=NUMA_BIND.remove + ("init_threads_binding",),
)
NUMA_TESTS = UT + "test_numa_utils.py"
DEVICES = P + "devices.py"
#: devices.py for CUDA alone, until XPU identity joins it.
_DEVICES_CUDA = (
    (
        '    "xpu": {("8086", kind) for kind in ("0300", "0380", "1200")},\n',
        "",
    ),
    (
        """expected cuda, xpu "
            "or cpu.""",
        "expected cuda or cpu.",
    ),
    (
        Span(
            '    vendor, order, note, flat = "NVIDIA", "PCI bus order", "", ""\n',
            "    elif len(listed) != 1",
        ),
        """    vendor, order, note = "NVIDIA", "PCI bus order", ""
    if len(listed) != 1""",
    ),
    (
        '({origin}){flat}",',
        '({origin})",',
    ),
    (
        Span(
            "    else:\n        # Level Zero's mask filters",
            """ skipped" if skipped else ""\n""",
        ),
        "",
    ),
    (
        Span(
            '    if device == "cuda":\n        return _cuda_entry(',
            '{origin}{note}")\n',
        ),
        """    return _cuda_entry(entries[gpu_id], f"{var}={value!r} entry {gpu_id}")
""",
    ),
)

#: The command line before verify and capture join it.
_VERIFY_CLI = (
    (
        '    verify = sub.add_parser("verify", help="start the ranks, read each binding back")\n',
        "",
    ),
    (
        '(plan, ("mp", "ray")), (verify, ("mp", "ray", "both"))',
        '(plan, ("mp", "ray")),',
    ),
    (
        "    # One thread per dp rank, as sglang's data-parallel controller starts them.\n"
        '    verify.add_argument("--dp-threads", action="store_true")\n'
        '    verify.add_argument("--timeout", type=_seconds, default=120.0, help="seconds")\n',
        "",
    ),
    ('"plan": cmd_plan, "verify": cmd_verify, ', '"plan": cmd_plan, '),
)
_CAPTURE_CLI = (
    (
        '    capture = sub.add_parser("capture", help="copy the sysfs files plan reads into DIR")\n'
        '    capture.add_argument("dir", metavar="DIR", type=_path("DIR"))\n'
        '    capture.add_argument("--sysfs-root", default="/sys", type=_path("--sysfs-root"))\n',
        "",
    ),
    ('"plan": cmd_plan, "capture": cmd_capture}', '"plan": cmd_plan}'),
)
MAIN = T + "__main__.py"
SPAWN = G + "spawn.py"

#: The spawn before it watches each child leave numactl and checks the block.
_SPAWN_UNWATCHED = (
    (
        Span("    executable = os.fsdecode(", "    problems = []\n"),
        """    logger.info(f"{who}: the scheduler starts under {' '.join(prefix)}")
    with spawn_with_prefix(prefix):
        yield
""",
    ),
    (
        Span(
            "    after = os.fsdecode(",
            '"; ".join(problems), log=logger)\n',
        ),
        "",
    ),
)

RESOLVE = P + "resolve.py"
PLAN = P + "plan.py"

#: resolve for the Ray actor alone: its GPU's node, bound in-process (Ray never execs
#: numactl). The affinity modes' shares and numactl's ladder join it next.
_RESOLVE_NODE_IN_PROCESS = (
    (
        "Then how (exec, in-process,\nV1): numactl is asked once per option set, on "
        "the rank's own host.",
        "Then how (in-process,\nV1).",
    ),
    (
        Span(
            "class HostCapabilities:  # what can apply a binding",
            "AssumedNumactl(root=root), libnuma=True)\n",
        ),
        """class HostCapabilities:  # what can apply a binding
    libnuma: bool

    @classmethod
    def live(cls) -> "HostCapabilities":
        from sglang.srt.placement.libnuma import load_libnuma

        return cls(libnuma=load_libnuma() is not None)
""",
    ),
    (
        Span(
            '    if policy.affinity_mode == "socket":\n',
            '{format_cpulist(node_ids)}"\n        )\n',
        ),
        "",
    ),
    (
        Span(
            "    if policy.affinity_mode not in SHARING_MODES:\n",
            "*share.reasons), share.warning)\n",
        ),
        "    return Choice((node.node_id, cpus, nodes, whole), tuple(reasons))\n",
    ),
    (
        Span(
            "    numactl = facts.capabilities.numactl\n",
            'cannot start this rank under numactl"\n        )\n',
        ),
        """    reasons.append(
        f"the {policy.launcher} launcher cannot start this rank under numactl"
    )
""",
    ),
    (
        "and how: exec\n    under the strongest numactl form the kernel accepts, else "
        "in-process (libnuma),\n    or the legacy V1 bind",
        "and how:\n    in-process (libnuma), or the legacy V1 bind",
    ),
)
#: place_gpu_id for a Ray actor, which names its rank and never has the CPU device's
#: groups: sglang's rank arithmetic and the CPU groups come with the CPU ranks.
_PLAN_LABELLED_GPU = (
    (
        """    if rank is None:
        ranks = [r for r in local_ranks(server_args) if r.gpu_id == gpu_id]
        rank = ranks[0] if ranks else RankIdentity(0, 0, 0, gpu_id)
""",
        """    if rank is None:
        rank = RankIdentity(0, 0, 0, gpu_id)
""",
    ),
    (
        "(default: the local rank sglang's arithmetic gives\n    ``gpu_id``); for the "
        "CPU device ``gpu_id`` is the rank's ``numa_index``.",
        "(default: rank 0 with\n    that ``gpu_id``).",
    ),
    (
        Span(
            "    topology, spec = facts.topology, policy.cpu_threads_bind\n",
            "shared_cpus(spec, index=gpu_id))\n",
        ),
        "    topology = facts.topology\n",
    ),
    ("places only cuda, xpu and cpu ranks", "places only cuda and xpu ranks"),
    (
        Span(
            '    elif not listed and policy.affinity_mode == "node"',
            'share it out between its GPUs)"\n        )\n',
        ),
        """    elif not listed and len(topology.cpu_nodes) < 2:
        why = "this host has one NUMA node with CPUs: node binding cannot help"
""",
    ),
)

RAY_RANK = G + "ray_rank.py"
TYPES = P + "types.py"
TOPOLOGY = P + "topology.py"
#: Only the reader of a sysfs file, and of a process's affinity, before the host's.
_TOPOLOGY_FILES = (
    (
        Span('"""Host facts read from a sysfs root', 'marker carries it)."""'),
        '"""Host facts read from a sysfs root: the live /sys or a fake."""',
    ),
)
#: A placement before the tools write it out and read it back.
_TYPES_UNREAD = ((Span("    def to_dict(self)", "**given)\n"), ""),)
RAY_TESTS = RT + "test_scheduler_actor.py"

#: The actor's own bind, before placement decides for every rank: its GPU's node
#: from sysfs (Ray's id in PCI bus order), or the --numa-node list.
_RAY_ALONE = (
    (
        Span("import os\n", "env=env, rank=rank\n    )\n"),
        r'''import functools
import os
import re
from typing import TYPE_CHECKING, Optional, Sequence

from sglang.srt.placement import settings
from sglang.srt.placement.apply import (
    BindOutcome,
    bind_in_process,
    enforce_failure_policy,
)
from sglang.srt.placement.cpulist import parse_cpulist
from sglang.srt.placement.topology import read_file, read_process_affinity
from sglang.srt.placement.types import (
    MemPolicy,
    PlacementError,
    ProcessPlacement,
    RankIdentity,
    Strategy,
)

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

_NODES, _PCI = "devices/system/node", "bus/pci/devices"
_PCI_ADDRESS = r"[0-9a-f]{4,8}:[0-9a-f]{2}:[01][0-9a-f]\.[0-7]"
_NVIDIA_GPUS = {("0x10de", "0x0300"), ("0x10de", "0x0302")}  # display, 3D: no audio


def _read(rel: str, pattern: str = ".*") -> str:
    path = os.path.join(settings.sysfs_root(), rel)
    fix = "set SGLANG_SYSFS_ROOT to a sysfs tree such as /sys"
    text = read_file(path, fix=fix).decode("ascii", "replace").strip().lower()
    if re.fullmatch(pattern, text) is None:
        raise PlacementError(f"{path}: {text[:40]!r} is not what sysfs writes; {fix}")
    return text


def _listed(rel: str, pattern: str) -> list[str]:
    path = os.path.join(settings.sysfs_root(), rel)
    names = os.listdir(path) if os.path.isdir(path) else ()  # no NUMA: no nodes
    found = [name for name in names if re.fullmatch(pattern, name)]
    return sorted(found, key=lambda name: (len(name), name))  # PCI bus order


def actor_placement(
    server_args: "ServerArgs", *, rank: RankIdentity, assigned_gpus: Sequence[str]
) -> ProcessPlacement:
    """Its GPU's node: Ray's id counts the host's NVIDIA GPUs in PCI bus order, as
    sysfs lists them (CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
    unbound = functools.partial(ProcessPlacement.unbound, rank, launcher="ray")
    gpu_id, listed, pci = rank.gpu_id, getattr(server_args, "numa_node", None), None
    nodes = {
        int(name[4:]): parse_cpulist(_read(f"{_NODES}/{name}/cpulist"))
        for name in _listed(_NODES, "node[0-9]{1,9}")
    }
    if listed is not None and gpu_id >= len(listed):
        raise settings.SettingError(
            f"--numa-node has {len(listed)} entries but {rank.label} uses GPU "
            f"{gpu_id}: give one node per GPU id"
        )
    if listed is None and not settings.auto_numa_bind():
        why = "no --numa-node and SGLANG_AUTO_NUMA_BIND=0: not binding"
        return unbound(reasons=[why], failure=False)
    if listed is None and sum(map(bool, nodes.values())) < 2:
        why = "this host has one NUMA node with CPUs: node binding cannot help"
        return unbound(reasons=[why], failure=False)
    if listed is not None:
        node, reason = listed[gpu_id], f"node {listed[gpu_id]} from --numa-node"
    else:
        gpus = [
            address
            for address in _listed(_PCI, _PCI_ADDRESS)
            if (_read(f"{_PCI}/{address}/vendor"), _read(f"{_PCI}/{address}/class")[:6])
            in _NVIDIA_GPUS
        ]
        if not assigned_gpus or gpu_id >= len(gpus):
            why = f"GPU {gpu_id} is not Ray's, or not among sysfs's {len(gpus)} GPUs"
            return unbound(reasons=[why], failure=True)
        pci = gpus[gpu_id]
        node = int(_read(f"{_PCI}/{pci}/numa_node", "-?[0-9]{1,9}"))
        reason = f"GPU {gpu_id} is {pci} in PCI bus order, on node {node}"
    affinity = read_process_affinity()
    cpus = nodes.get(node, frozenset()) & affinity.cpus
    if not cpus:  # -1: the kernel does not know the device's node
        why = f"{reason}, which has no CPU this process may use"
        return unbound(reasons=[why], failure=True, pci=pci)
    mems = frozenset([node]) & affinity.mems
    return ProcessPlacement(
        rank=rank,
        pci=pci,
        numa_node=node,
        cpus=cpus,
        mem_nodes=mems,
        mem_policy=MemPolicy.BIND if mems else MemPolicy.NONE,
        strategy=Strategy.IN_PROCESS,
        reasons=(reason, "bound in-process"),
        launcher="ray",
    )
''',
    ),
)

SERIES: Tuple[Patch, ...] = (
    Patch(
        "shm-segments",
        "distributed: each CPU engine's /dev/shm segments named by its own init "
        "address, unlinked once mapped",
        "_init_cpu_threads_env hands the CPU collective an explicit ShmNamespace per "
        "engine and pipeline stage (LOCAL_SIZE stays as upstream sets it), never "
        "MASTER_ADDR/MASTER_PORT; _init_parallel_groups unlinks the names after a "
        "barrier on the TP group. Another user's file under its names, a full or "
        "read-only /dev/shm are errors naming the path and the fix.",
        "Co-located CPU engines (data parallel behind sglang-router) and pipeline "
        "stages no longer share segments, and a killed engine leaves nothing in "
        "/dev/shm.",
        files=(
            D + "shm_namespace.py",
            D + "shm_collective.py",
            PY + "srt/distributed/bootstrap.py",
            DT + "test_shm_namespace.py",
            DT + "test_shm_collective.py",
            DT + "test_cpu_shm_segments.py",
        ),
        fixes="shm",
    ),
    Patch(
        "ray-actors",
        "ray: scheduler actors bind themselves to their own GPU's node",
        "Each SchedulerActor finds the GPU Ray gave it by Ray's id (never index 0 of "
        "its one-GPU CUDA_VISIBLE_DEVICES) among the host's NVIDIA GPUs in sysfs (or "
        "takes the --numa-node list), and binds to that GPU's node in-process before "
        "its Scheduler exists: every thread, the memory policy, the pages touched so "
        "far, through placement's in-process bind (one libnuma loader, one failure "
        "policy). _create_scheduler_actor stays as upstream wrote it; the placement "
        "settings join envs (SGLANG_SYSFS_ROOT names the sysfs tree read).",
        "Ray scheduler actors on nodes with several GPUs are bound to their own GPU's "
        "node, every thread (they were unbound, or bound to the wrong node).",
        files=(PY + "srt/ray/scheduler_actor.py", PY + "srt/environ.py"),
        partial=(
            Partial(RAY_RANK, keep=("bind_scheduler_actor",), swap=_RAY_ALONE),
            Partial(TYPES, keep=("ProcessPlacement",), swap=_TYPES_UNREAD),
            Partial(TOPOLOGY, keep=("read_file",), swap=_TOPOLOGY_FILES),
            Partial(RAY_TESTS, keep=("TestRayActorPlacement",)),
        ),
        fixes="ray",
    ),
    Patch(
        "numa-utils-nodes",
        "numa_utils: a host's NUMA nodes and CPUs read once, from SGLANG_SYSFS_ROOT",
        "_is_numa_available and _node_cpus read the host through placement's "
        "topology: sparse node ids, memory-only nodes, offline CPUs and a restricted "
        "process, from /sys or a snapshot.",
        "SGLANG_SYSFS_ROOT points numa_utils at a captured topology, and a node "
        "without CPUs or memory no longer counts towards a NUMA host.",
        files=(PT + "test_topology.py",),
        partial=(
            NUMA_NODES,
            Partial(TOPOLOGY, keep=("read_topology",)),
            Partial(
                NUMA_TESTS,
                keep=("TestIsNumaAvailable", "TestIsNumaAvailableSysfsRoot"),
            ),
        ),
    ),
    Patch(
        "numa-utils-discovery",
        "numa_utils: find a CUDA GPU's node through its PCI address",
        "_query_numa_node_for_gpu names the node of the device's PCI address, found "
        "through CUDA_VISIBLE_DEVICES (indices, GPU- and MIG- UUIDs; NVML optional); "
        "placement's device identity knows CUDA only, and XPU keeps upstream's path, "
        "for one more patch.",
        "get_numa_node_if_available finds GPUs named by UUID in CUDA_VISIBLE_DEVICES "
        "and answers from the PCI numa_node, without NVML's memory-affinity mask.",
        files=(PT + "test_devices.py",),
        partial=(
            NUMA_DISCOVERY,
            Partial(DEVICES, keep=("identify_accelerators",), swap=_DEVICES_CUDA),
            Partial(NUMA_TESTS, keep=("TestQueryNumaNodeForGpu",)),
        ),
    ),
    Patch(
        "numa-utils-xpu",
        "numa_utils: an XPU's node in Level Zero's order",
        "_query_numa_node_for_gpu answers XPU devices through placement's device "
        "identity, which learns Level Zero: ZE_AFFINITY_MASK filters (card.tile names its card), Level Zero "
        "numbers integrated GPUs last unless ZE_ENABLE_PCI_ID_DEVICE_ORDER is set; "
        "upstream's XPU helpers go.",
        "An XPU rank under ZE_AFFINITY_MASK or with an integrated GPU present is "
        "bound to the node of the device Level Zero gives it, read from sysfs.",
        files=(UT + "test_numa_utils_xpu.py",),
        partial=(
            NUMA_XPU,
            Partial(DEVICES, keep=("identify_accelerators",)),
            Partial(
                NUMA_TESTS,
                keep=("TestGraceBlackwellNumaTopology", "TestB200NumaTopology"),
            ),
        ),
    ),
    Patch(
        "numa-bind-to-node",
        "numa_utils: numa_bind_to_node moves every thread",
        "numa_bind_to_node, _can_set_mempolicy and the failure policy bind through "
        "placement with one libnuma loader.",
        "numa_bind_to_node (the legacy V1 path, the diffusion worker) moves every "
        "thread of the process, not only the calling one.",
        files=(PT + "test_bind_in_process.py",),
        partial=(
            NUMA_BIND,
            Partial(
                NUMA_TESTS,
                keep=(
                    "TestGetNumaNodeIfAvailable",
                    "TestNumaBindIntersectionInProcess",
                ),
            ),
        ),
    ),
    Patch(
        "ray-actors-placement",
        "ray: a scheduler actor is placed as every rank is",
        "The actor's own sysfs lookup gives way to placement's: device identity (its "
        "CUDA_VISIBLE_DEVICES when Ray names no GPU, UUIDs through NVML) and "
        "resolve, which binds a GPU rank to its node in-process only (Ray never "
        "execs numactl); the actor names its own rank.",
        "A Ray scheduler actor that Ray gives no GPU id is bound to the GPU its "
        "CUDA_VISIBLE_DEVICES names (it was left unbound), and one whose GPU is named "
        "by UUID finds it through NVML; every SGLANG_NUMA_AFFINITY_MODE binds the "
        "actor to the whole node until the next patch.",
        files=(RAY_RANK,),
        partial=(
            Partial(
                RESOLVE, keep=("resolve_placement",), swap=_RESOLVE_NODE_IN_PROCESS
            ),
            Partial(PLAN, keep=("place_gpu_id",), swap=_PLAN_LABELLED_GPU),
            Partial(RAY_TESTS, keep=("TestRayActorWithoutRaysIds",)),
        ),
    ),
    Patch(
        "affinity-modes",
        "placement: exclusive, core-complex and socket modes, and numactl's ladder",
        "SGLANG_NUMA_AFFINITY_MODE shares a node out between its GPUs: exclusive "
        "gives each GPU a contiguous slice of the node's whole cores, core-complex "
        "one L3 group, socket every node of the GPU's package; each rank computes "
        "its own GPU's share alone from sysfs, by its index among the node's GPUs "
        "in PCI order. resolve learns the exec path too: numactl's probe ladder "
        "(--membind, --preferred, CPU only), each option set probed once, which "
        "configure_subprocess uses two patches later.",
        "Under SGLANG_NUMA_AFFINITY_MODE=exclusive, core-complex or socket a Ray "
        "scheduler actor is bound to its GPU's share of the node (or its whole "
        "socket), not the whole node as in node mode.",
        files=(RAY_TESTS, PT + "test_numactl_ladder.py"),
        partial=(
            Partial(RESOLVE, keep=("resolve_placement",)),
            Partial(NUMA_TESTS, keep=("TestStripMemoryArgs",)),
        ),
    ),
    Patch(
        "cpu-omp-threads",
        "numa_utils: a CPU-device rank's OpenMP CPUs read as placement reads them",
        "init_threads_binding takes SGLANG_CPU_OMP_THREADS_BIND through placement's "
        "settings and CPU groups: 'all' gives the rank one CPU per physical core of "
        "its node, a cpulist group is taken as written; the group count bounds the "
        "rank index (a router's one-rank worker counts across the setting). "
        "place_gpu_id places a CPU-device rank by its group, and names a rank it is "
        "not given by sglang's rank arithmetic.",
        "A SGLANG_CPU_OMP_THREADS_BIND that cannot work (too few groups, a bad "
        "cpulist, CPUs offline or outside the affinity) is an error naming the "
        "setting, the value and the fix, not an assert; groups sharing CPUs get a "
        "WARNING.",
        files=(PT + "test_placement_settings.py",),
        partial=(
            NUMA_CPU,
            Partial(NUMA_TESTS, keep=("TestInitThreadsBinding",)),
            Partial(PLAN, keep=("place_gpu_id",)),
        ),
    ),
    Patch(
        "configure-subprocess",
        "numa_utils: every spawned scheduler starts under its placement",
        "Each spawn inside configure_subprocess(server_args, gpu_id) starts under "
        "numactl with the placement of that GPU id (CPU-device ranks too), through a "
        "thread-local wrapper of the spawn that prefixes the child's command line "
        "only; numactl's probe ladder (--membind, --preferred, CPU only) picks the "
        "options. Upstream's script in /tmp and swapped spawn executable go.",
        "CPU-device ranks start under numactl (SGLANG_NUMA_BIND_V2=0 restores "
        "upstream); a rank less bound than intended gets one WARNING, or an error "
        "before any child starts under SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1.",
        files=(NUMA, PT + "test_spawn_hook.py"),
        partial=(
            Partial(SPAWN, keep=("placed_spawn",), swap=_SPAWN_UNWATCHED),
            Partial(
                NUMA_TESTS,
                keep=(
                    "TestNumaBindIntersection",
                    "TestProbeNumactlArgs",
                    "TestConfigureSubprocessProbeFailure",
                ),
            ),
        ),
    ),
    Patch(
        "spawn-reports",
        "scheduler_placement: a placed spawn's failures reported by rank",
        "A watcher thread sees each placed child leave numactl; one that dies as "
        "numactl is reported with numactl's own reason, asked again with the same "
        "options. configure_subprocess also reports a block that spawned nothing "
        "under the prefix, or whose spawn executable another library swapped.",
        "A scheduler that numactl refuses to start (a cpuset that shrank since the "
        "probe) gets an ERROR naming the rank and numactl's message, instead of a "
        "bare exit status 1; a launch path that bypassed the spawn hook gets a "
        "WARNING.",
        files=(SPAWN, NUMA_TESTS),
    ),
    Patch(
        "tools-plan",
        "placement_tools: python -m sglang.srt.placement_tools plan",
        "One line per rank saying what sglang's launch path will do and why, or JSON; "
        "bounded input. A package on top: nothing below imports it. The placement "
        "modules reach their final content with the engine-wide plan it prints.",
        "A new command: plan prints each rank's node, CPUs, memory policy and why.",
        files=(
            P + "__init__.py",
            P + "cpulist.py",
            P + "types.py",
            P + "settings.py",
            P + "policy.py",
            P + "topology.py",
            DEVICES,
            P + "libnuma.py",
            P + "apply.py",
            P + "numactl.py",
            P + "resolve.py",
            P + "ranks.py",
            P + "cpu_groups.py",
            P + "plan.py",
            G + "__init__.py",
            T + "__init__.py",
            PT + "test_resolve.py",
            PT + "test_place_gpu_id.py",
            TT + "test_plan.py",
        ),
        partial=(Partial(MAIN, keep=("main",), swap=_VERIFY_CLI + _CAPTURE_CLI),),
    ),
    Patch(
        "tools-capture-read-back",
        "placement_tools: capture a host's topology, read a rank's binding back",
        "capture saves the sysfs files placement reads, for plan --sysfs-root; the "
        "read-back gives CPUs, allowed memory nodes, memory policy and where the "
        "pages are, compared with the placement.",
        "plan for another host from its snapshot.",
        files=(T + "capture.py", TT + "test_capture.py"),
        partial=(Partial(MAIN, keep=("main",), swap=_VERIFY_CLI),),
    ),
    Patch(
        "tools-verify",
        "placement_tools: verify through sglang's own launchers",
        "Probe ranks started inside configure_subprocess and through "
        "_create_scheduler_actor report their binding from inside.",
        "verify says, rank by rank, whether the launch path bound each rank as planned.",
        files=(MAIN, T + "verify.py", T + "verify_ray.py", TT + "test_verify.py"),
    ),
)


# --------------------------------------------------------------------------- intermediate states


def _names(node: ast.stmt) -> Tuple[str, ...]:
    """The top-level names a definition or assignment defines; () for anything else."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return (node.name,)
    targets = {
        ast.Assign: lambda n: n.targets,
        ast.AnnAssign: lambda n: [n.target],
        ast.AugAssign: lambda n: [n.target],
    }.get(type(node), lambda n: [])(node)
    return tuple(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))


def _bound(node: ast.stmt) -> Tuple[str, ...]:
    """The names an import binds (or an ``if`` holding only imports, as ``if TYPE_CHECKING:``)."""
    if isinstance(node, ast.Import):
        return tuple((a.asname or a.name).split(".")[0] for a in node.names)
    if isinstance(node, ast.ImportFrom) and node.module != "__future__":
        return tuple(a.asname or a.name for a in node.names)
    if isinstance(node, ast.If) and not node.orelse:
        inner = [_bound(s) if isinstance(s, ast.ImportFrom) else () for s in node.body]
        if all(inner) and all(isinstance(s, ast.ImportFrom) for s in node.body):
            return tuple(n for names in inner for n in names)
    return ()


def _uses(node: ast.AST) -> Set[str]:
    """Names a statement reads, identifier strings (forward references) included."""
    return {
        n.id if isinstance(n, ast.Name) else n.value
        for n in ast.walk(node)
        if isinstance(n, ast.Name)
        or (
            isinstance(n, ast.Constant)
            and isinstance(n.value, str)
            and n.value.isidentifier()
        )
    }


def sliced(final: str, roots: Iterable[str]) -> str:
    """``final`` cut to ``roots``: its top-level definitions named there, what they use
    from the same file, the imports of what is kept, and every other statement
    (docstring, calls such as ``register_cpu_ci(...)``, ``if __name__`` blocks).
    """
    body = ast.parse(final).body
    by_name: Dict[str, List[int]] = {}
    for index, node in enumerate(body):
        for name in _names(node) or _bound(node):
            by_name.setdefault(name, []).append(index)
    todo = [i for i, n in enumerate(body) if not (_names(n) or _bound(n))]
    todo += [i for root in roots for i in by_name.get(root, ())]
    keep: Set[int] = set()
    while todo:
        index = todo.pop()
        if index not in keep:
            keep.add(index)
            todo += [i for name in _uses(body[index]) for i in by_name.get(name, ())]
    used = {
        name
        for i in keep
        if not isinstance(body[i], (ast.Import, ast.ImportFrom))
        for name in _uses(body[i])
    }
    return _render(final, body, keep, used)


def _import_text(node: ast.ImportFrom, used: Set[str], text: List[str]) -> List[str]:
    """The import ``node`` (``text``), its names cut to ``used``, as black writes it."""
    names = [a for a in node.names if (a.asname or a.name) in used]
    if len(names) == len(node.names):
        return text
    shown = [a.name + (f" as {a.asname}" if a.asname else "") for a in names]
    line = f"from {node.module} import {', '.join(shown)}"
    if len(line) <= 88:
        return [line + "\n"]
    return [f"from {node.module} import (\n", *(f"    {n},\n" for n in shown), ")\n"]


def _render(
    final: str, body: Sequence[ast.stmt], keep: Set[int], used: Set[str]
) -> str:
    """The statements of ``body`` at ``keep``, each with the comments above it; two
    blank lines around a def or class, other statements keep their own spacing, or
    that of the statements dropped before them (at most two), as black spaces them."""
    lines = final.splitlines(keepends=True)
    out: List[str] = []
    previous = None
    end = 0
    dropped = 0  # the blank lines before the statements dropped since the last kept
    for index, node in enumerate(body):
        chunk, end = lines[end : node.end_lineno], node.end_lineno
        text = list(chunk)
        while text and not text[0].strip():
            text.pop(0)
        blank = len(chunk) - len(text)
        if index not in keep:
            dropped = max(dropped, blank)
            continue
        if previous is not None and (_is_def(node) or _is_def(previous)):
            blank = 2
        elif isinstance(previous, (ast.Import, ast.ImportFrom)) and not _bound(node):
            blank, dropped = 1, 0  # isort's one blank line after imports
        out += ["\n"] * (0 if previous is None else min(max(blank, dropped), 2))
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            comments = len(text) - (node.end_lineno - node.lineno + 1)
            text = text[:comments] + _import_text(node, used, text[comments:])
        out += text
        previous, dropped = node, 0
    return "".join(out).rstrip("\n") + "\n"


def _is_def(node: ast.stmt) -> bool:
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))


@functools.lru_cache(maxsize=None)
def _defined(source: str) -> FrozenSet[str]:
    body = ast.parse(source).body
    return frozenset(n for node in body for n in _names(node) + _bound(node))


@functools.lru_cache(maxsize=None)
def imports_of(source: str) -> Tuple[Tuple[str, str, FrozenSet[str]], ...]:
    """(module, name, the attributes ``source`` reads on that name) for every
    ``from sglang... import name`` in ``source``, nested ones included."""
    tree = ast.parse(source)
    attributes: Dict[str, Set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            attributes.setdefault(node.value.id, set()).add(node.attr)
    return tuple(
        (
            node.module,
            alias.name,
            frozenset(attributes.get(alias.asname or alias.name, ())),
        )
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and not node.level
        and node.module.split(".")[0] == "sglang"
        for alias in node.names
    )


def _spans(source: str) -> Dict[str, Tuple[int, int]]:
    """Top-level name -> (first line, last line) of what defines it, 1-based, decorators included."""
    spans = {}
    for node in ast.parse(source).body:
        decorators = getattr(node, "decorator_list", [])
        first = min([node.lineno, *(d.lineno for d in decorators)])
        spans.update((name, (first, node.end_lineno)) for name in _names(node))
    return spans


def swapped(
    text: str,
    swaps: Iterable[Tuple[Union[str, Span], str]],
    refuse: Callable,
    where: str,
) -> str:
    """``text`` with each (old, new) of ``swaps`` done; an old (a text, or a Span's
    first text) not found exactly once, or a Span without its last text, is refused."""
    for old, new in swaps:
        first = old.first if isinstance(old, Span) else old
        if text.count(first) != 1:
            raise refuse(
                f"{where} swaps a text found {text.count(first)} times, not once "
                f"(fix or drop the swap): {first.strip()[:80]!r}"
            )
        start = text.index(first)
        end = start + len(first)
        if isinstance(old, Span):
            stop = text.find(old.last, end)
            if stop < 0:
                raise refuse(
                    f"{where} swaps a span whose end is not after its start (fix "
                    f"or drop the swap): {old.last.strip()[:80]!r}"
                )
            end = stop + len(old.last)
        text = text[:start] + new + text[end:]
    return text


def edited(upstream: str, final: str, partial: Partial) -> str:
    """``upstream`` with ``partial``'s definitions taken from ``final``, removed, or added."""
    ours, theirs = _spans(final), _spans(upstream)
    final_lines = final.splitlines(keepends=True)
    lines = upstream.splitlines(keepends=True)

    def block(name: str) -> List[str]:
        first, last = ours[name]
        return final_lines[first - 1 : last] + ["\n", "\n"]

    edits: List[Tuple[int, int, List[str]]] = []  # (start, end) 0-based half-open
    for name in partial.remove:
        first, last = theirs[name]
        edits.append((first - 1, _gap_end(lines, last), []))
    for name in partial.replace:
        first, last = theirs[name]
        added = [
            line for extra in partial.add_before.get(name, ()) for line in block(extra)
        ]
        edits.append((first - 1, _gap_end(lines, last), added + block(name)))
    for start, end, new in sorted(edits, reverse=True):
        lines[start:end] = new
    text = "".join(lines).rstrip("\n") + "\n"
    for line in partial.imports:
        text = _with_import(text, line)
    return text


def _with_import(text: str, line: str) -> str:
    """``text`` with the ``from X import ...`` statement ``line`` where isort puts it:
    in place of upstream's import from X, else before the first import from a module
    of X's package that sorts after X, else after the last import."""
    module = ast.parse(line).body[0].module
    lines = text.splitlines(keepends=True)
    imports = [
        n for n in ast.parse(text).body if isinstance(n, (ast.Import, ast.ImportFrom))
    ]
    from_imports = [n for n in imports if isinstance(n, ast.ImportFrom) and not n.level]
    same = [n for n in from_imports if n.module == module]
    later = [
        n
        for n in from_imports
        if n.module.split(".")[0] == module.split(".")[0]
        and n.module.lower() > module.lower()
    ]
    if same:
        start, end = same[0].lineno - 1, same[0].end_lineno
    elif later:
        start = end = later[0].lineno - 1
    else:
        start = end = imports[-1].end_lineno
    lines[start:end] = [line + "\n"]
    return "".join(lines)


def _gap_end(lines: Sequence[str], last: int) -> int:
    """The index after definition line ``last`` and the blank lines that follow it."""
    end = last
    while end < len(lines) and not lines[end].strip():
        end += 1
    return end


def _lacking(state: str, final: str, partial: Partial) -> List[str]:
    """Top-level names of ``final`` that the definitions ``partial`` takes from it
    use, and that ``state`` does not define."""
    taken = {*partial.replace, *(n for v in partial.add_before.values() for n in v)}
    used = {
        name
        for node in ast.parse(final).body
        if set(_names(node)) & taken
        for name in _uses(node)
    }
    return sorted((used & _defined(final)) - _defined(state))


def _edit_problems(
    old: Optional[str], final: str, partial: Partial, where: str
) -> List[str]:
    """What is wrong with ``partial``, each naming the file and the definition."""
    final_names = _defined(final)
    named = [*partial.keep, *partial.replace]
    named += [n for names in partial.add_before.values() for n in names]
    problems = [
        f"{where} names {n}, which the final {partial.path} does not define"
        for n in named
        if n not in final_names
    ]
    edits = (*partial.replace, *partial.remove, *partial.imports, *partial.add_before)
    if partial.keep and edits:
        problems.append(f"{where} both keeps and edits {partial.path}")
    elif partial.keep and old is not None:
        problems.append(
            f"{where} keeps names of {partial.path}, which upstream has: edit it "
            "(replace, add_before, remove) instead"
        )
    elif edits and old is None:
        problems.append(
            f"{where} edits {partial.path}, which is new: name what it keeps instead"
        )
    elif edits:
        upstream_names = set(_spans(old))
        problems += [
            f"{where} replaces or removes {n}, which upstream's {partial.path} lacks"
            for n in (*partial.replace, *partial.remove)
            if n not in upstream_names
        ]
    return problems


# --------------------------------------------------------------------------- building


def path_of(change) -> str:
    """A change's path in a checkout, whichever form the overlay ran in."""
    return f"{TEST if change.area == 'test' else PY}{change.rel}"


class _States:
    """Every changed file's content as the series has it so far, and the slices of
    new modules that the files reached so far import from."""

    def __init__(self, by_path: Dict[str, Any], refuse: Callable[[str], Exception]):
        self.by_path = by_path
        self.refuse = refuse
        self.text: Dict[str, Optional[str]] = {
            p: c.old and c.old.decode() for p, c in by_path.items()
        }
        self.final: Set[str] = set()
        self.roots: Dict[str, Set[str]] = {}
        self.base: Dict[str, str] = {}  # a new file's final text with a Partial's swaps

    def final_text(self, path: str) -> str:
        return self.by_path[path].new.decode()

    def sliceable(self, path: str) -> bool:
        change = self.by_path.get(path)
        return change is not None and change.old is None and path not in self.final

    def grow(self, where: str) -> None:
        """Slice every new module that a file reached so far imports from, to what it
        imports (and what that uses), until nothing more is needed."""
        while True:
            for importer, text in list(self.text.items()):
                if text is not None and importer.endswith(".py"):
                    for module, name, attributes in imports_of(text):
                        self._need(importer, module, name, attributes, where)
            grown = {
                path: sliced(
                    self.base.get(path) or self.final_text(path), sorted(roots)
                )
                for path, roots in self.roots.items()
                if self.sliceable(path)
            }
            grown = {p: t for p, t in grown.items() if t != self.text[p]}
            if not grown:
                return
            self.text.update(grown)

    def _need(self, importer, module, name, attributes, where) -> None:
        base = "python/" + module.replace(".", "/")
        submodule = self._path(f"{base}/{name}")
        target, roots = (
            (submodule, attributes) if submodule else (self._path(base), {name})
        )
        parts = module.split(".")
        for depth in range(1, len(parts) + 1):  # the packages Python imports on the way
            package = f"python/{'/'.join(parts[:depth])}/__init__.py"
            if self.sliceable(package):
                self.roots.setdefault(package, set())
        if target is None or not self.sliceable(target):
            return
        missing = sorted(set(roots) - _defined(self.final_text(target)))
        if missing:
            raise self.refuse(
                f"{where}: {importer} imports {', '.join(missing)} from {target}, "
                "which its final content does not define"
            )
        self.roots.setdefault(target, set()).update(roots)

    def _path(self, base: str) -> Optional[str]:
        for path in (f"{base}.py", f"{base}/__init__.py"):
            if path in self.by_path:
                return path
        return None


def build(
    changes: Sequence,
    *,
    with_tests: bool,
    change_type: Callable,
    unified_diff: Callable,
    refuse: Callable[[str], Exception],
    series: Sequence[Patch] = SERIES,
    max_lines: Optional[int] = MAX_CHANGED_LINES,
) -> List[Tuple[Patch, List[str], int]]:
    """(patch, its diff lines, lines changed) for each patch of ``series``, from the overlay's
    changes to a pristine package or checkout (``change_type`` builds one,
    ``unified_diff`` prints one). The ported tests are always among ``changes``
    (their imports shape the slices either way), but written only ``with_tests``.
    """
    by_path = {path_of(c): c for c in changes}
    states = _States(by_path, refuse)
    claimed: Dict[str, str] = {}
    out = []
    for index, patch in enumerate(series, 1):
        where = f"patch {index} ({patch.slug})"
        before = dict(states.text)
        order: List[str] = []
        steps = [(p.path, p) for p in patch.partial] + [(f, None) for f in patch.files]
        for path, partial in steps:
            if path in claimed:
                raise refuse(f"{path} is in patches {claimed[path]} and {where}")
            if path not in by_path:
                raise refuse(f"{where} names {path}, which the overlay does not change")
            order.append(path)
            if partial is None:
                claimed[path] = where
                states.final.add(path)
                states.text[path] = states.final_text(path)
                continue
            upstream = by_path[path].old and by_path[path].old.decode()
            problems = _edit_problems(upstream, states.final_text(path), partial, where)
            if problems:
                raise refuse("; ".join(problems))
            final = states.final_text(path)
            if partial.keep:
                states.roots.setdefault(path, set()).update(partial.keep)
                states.base[path] = swapped(final, partial.swap, refuse, where)
            else:
                text = edited(upstream, final, partial)
                lacking = _lacking(text, states.final_text(path), partial)
                if lacking:
                    raise refuse(
                        f"{where}: the state of {path} uses {', '.join(lacking)}, which "
                        "it lacks: add them to add_before (or imports)"
                    )
                states.text[path] = swapped(text, partial.swap, refuse, where)
        states.grow(where)
        order += sorted(p for p in states.text if p not in order)
        touched = [p for p in order if states.text[p] != before[p]]
        _check_header(patch, touched, where, refuse)
        diff: List[str] = []
        per_file: Dict[str, int] = {}  # lines changed
        for path in touched:
            if path.startswith(TEST) and not with_tests:
                continue
            change = by_path[path]
            old, new = before[path], states.text[path]
            text, added, removed = unified_diff(
                change_type(
                    change.rel,
                    old and old.encode(),
                    new.encode(),
                    change.mode,
                    "added" if old is None else "replaced",
                    change.area,
                )
            )
            diff += text
            per_file[path] = added + removed
        lines = sum(per_file.values())
        if max_lines is not None and lines > max_lines:
            largest = sorted(per_file.items(), key=lambda item: -item[1])
            raise refuse(
                f"{where} changes {lines} lines, more than {max_lines}: split it "
                f"({', '.join(f'{p} {n}' for p, n in largest)})"
            )
        out.append((patch, diff, lines))
    left = sorted(set(by_path) - set(claimed))
    if left:
        raise refuse(
            f"no patch of the series holds {', '.join(left)} at its final content: "
            "add it to SERIES"
        )
    return out


def fixed_at(
    built: Sequence[Tuple[Patch, List[str], int]]
) -> Dict[str, Tuple[int, int]]:
    """Bug key -> (the patch number that fixes it, the series' changed lines up to it)."""
    found, total = {}, 0
    for index, (patch, _, lines) in enumerate(built, 1):
        total += lines
        if patch.fixes:
            found[patch.fixes] = (index, total)
    return found


def _check_header(
    patch: Patch, touched: Sequence[str], where: str, refuse: Callable
) -> None:
    if any(p.startswith(PY) for p in touched) and not any(
        p.startswith(TEST) for p in touched
    ):
        raise refuse(
            f"{where} changes python/ but adds no test: give it a "
            f"{TEST}registered/<area>/test_*.py"
        )
    if not patch.operators.strip() or "nothing yet" in patch.operators.lower():
        raise refuse(
            f"{where}: its Operators notice says nothing an operator notices "
            f"({patch.operators!r}); make the patch change something they do"
        )


def header(patch: Patch, index: int, total: int) -> str:
    body = "\n".join(_wrap(patch.why))
    paths = [*patch.files, *(p.path for p in patch.partial)]
    tests = ", ".join(sorted({p for p in paths if p.startswith(TEST)}))
    return (
        f"Subject: [PATCH {index}/{total}] {patch.title}\n\n{body}\n\n"
        f"Tests: {tests}\nOperators notice: {patch.operators}\n---\n"
    )


def _wrap(text: str, width: int = 72) -> List[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return lines + ([line] if line else [])


def write(out: Path, built: Sequence[Tuple[Patch, List[str], int]]) -> List[str]:
    """Write the series into ``out`` (new, or an empty directory: ``overlay.py`` checks);
    returns one line per patch."""
    out.mkdir(parents=True, exist_ok=True)
    names, summary, total = [], [], 0
    for index, (patch, diff, lines) in enumerate(built, 1):
        name = f"{index:04d}-{re.sub(r'[^a-z0-9-]', '-', patch.slug)}.patch"
        (out / name).write_text(header(patch, index, len(built)) + "".join(diff))
        names.append(name)
        total += lines
        summary.append(f"{name}  {lines:4d} lines  {total:5d} in all  {patch.title}")
    (out / "series").write_text("".join(f"{n}\n" for n in names))
    for bug, (index, lines) in fixed_at(built).items():
        summary.append(f"fixed by patch {index}, {lines} changed lines in: {BUGS[bug]}")
    return summary
