"""sglang's NUMA helpers: upstream's names and steps, each decision made once by
``sglang.srt.placement``.

Upstream's callers drive these: the engine and the data-parallel controller wrap each
scheduler ``proc.start()`` in ``configure_subprocess(server_args, gpu_id)``;
``configure_scheduler_process`` (every spawned scheduler and every Ray
``SchedulerActor``) calls ``bind_scheduler_process``; the diffusion GPU worker calls
``get_numa_node_if_available`` then ``numa_bind_to_node``; bootstrap's CPU path calls
``init_threads_binding``.

One ``ProcessPlacement`` per rank (``place_gpu_id``) names its node, its CPUs (with
SGLANG_SET_CPU_AFFINITY=1 its slice of the node's cores) and its memory policy, and
who applies it: the spawn (under numactl), the rank itself in
``configure_scheduler_process`` (a Ray actor, the legacy V1 bind, upstream's
NUMA-blind slice where no node is known), or nobody, with the reasons.

The steps keep upstream's names, which upstream's own tests patch:
``get_numa_node_if_available`` (``_is_numa_available``, ``_query_numa_node_for_gpu``),
``_numactl_cpu_mem_args`` (``_node_cpus``), ``_can_set_mempolicy``,
``_strip_memory_args``, ``_probe_numactl_args`` (the one numactl ladder),
``_create_numactl_executable`` and ``_mp_set_executable``. Loading this module does
not initialise a device runtime: ``_is_cuda`` and ``_is_xpu`` are worked out on
first use (None until then).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import glob  # noqa: F401 - upstream's tests patch numa_utils.glob.glob
import logging
import multiprocessing
import multiprocessing.spawn
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Iterable, Iterator, Optional

from sglang.srt.placement import settings
from sglang.srt.placement.apply import BindOutcome, bind_in_process, handle_bind_failure
from sglang.srt.placement.devices import gpus_on_node, locate_gpu
from sglang.srt.placement.numactl import cpu_mem_args, strip_memory_args
from sglang.srt.placement.resolve import gpu_share, resolve_placement, strategy_for
from sglang.srt.placement.settings import PlacementPolicy
from sglang.srt.placement.topology import read_process_affinity, read_topology_cached
from sglang.srt.placement.types import (
    DeviceIndex,
    DeviceRef,
    HostTopology,
    Launcher,
    NodeChoice,
    PlacementError,
    ProcessAffinity,
    ProcessPlacement,
    RankIdentity,
    Strategy,
)

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Upstream computes these at import, where is_cuda()/is_xpu() import torch and ask the
# driver; here on first use.
_is_cuda: Optional[bool] = None
_is_xpu: Optional[bool] = None
# The data-parallel controller starts ranks from threads: one spawn executable at once.
_SPAWN_LOCK = threading.Lock()
_PROBE_TIMEOUT_S = 10
_NO_NUMACTL = "numactl is not installed (apt-get install numactl)"
_WRAPPER_WAIT_S = 10.0


def _platform_flag(name: str) -> bool:
    if globals()[name] is None:
        from sglang.srt.utils.common import is_cuda, is_xpu

        globals()[name] = bool(is_cuda() if name == "_is_cuda" else is_xpu())
    return bool(globals()[name])


def _gpu_device() -> str:
    return (
        "xpu"
        if _platform_flag("_is_xpu") and not _platform_flag("_is_cuda")
        else "cuda"
    )


# -- the placement of a rank ----------------------------------------------------------


class LiveHost:
    """This host, as the decision asks it (``placement.resolve.Host``): each step is
    upstream's helper of that name, looked up when asked."""

    def __init__(
        self, server_args: Optional["ServerArgs"], *, report_failures: bool = True
    ) -> None:
        self._server_args = server_args
        self._report = report_failures
        self._device = getattr(server_args, "device", None)
        self.numactl_path = shutil.which("numactl")
        self.libnuma = get_libnuma() is not None
        self._affinity: Optional[ProcessAffinity] = None

    def topology(self) -> HostTopology:
        return read_topology_cached()

    def affinity(self) -> ProcessAffinity:
        if self._affinity is None:  # read once per decision
            cpus, mems = os.sched_getaffinity(0), read_process_affinity().mems
            self._affinity = ProcessAffinity(frozenset(cpus), mems, "this process")
        return self._affinity

    def numa_node(self, rank: RankIdentity) -> NodeChoice:
        gpu = rank.device
        if gpu.numbering is DeviceIndex.LOGICAL_GPU:
            node = get_numa_node_if_available(self._server_args, gpu.index)
        else:
            node = _gpu_numa_node(self._server_args, gpu)
        choice = _node_choice(self._server_args, gpu, node)
        if choice.node is None and choice.reasons[0] == _NO_NUMACTL:
            why = f"{_NO_NUMACTL}; skipping NUMA binding for {gpu.label}."
            self.fail(None, why)  # upstream: a debug line, the rank silently slower
            return dataclasses.replace(choice, reasons=(why,), degraded=True)
        if choice.degraded and self._report and settings.bind_failure_is_fatal():
            # The query warned already; under the crash setting the rank stops here.
            self.fail(None, f"{choice.reasons[0]}; skipping NUMA binding.")
        return choice

    def node_cpus(self, node: int) -> frozenset[int]:
        return frozenset(_node_cpus(node))

    def node_gpus(self, node: int) -> tuple[str, ...]:
        device = self._device if self._device in ("cuda", "xpu") else "cuda"
        return gpus_on_node(self.topology(), device=device, node=node)

    def gpu_pci(self, rank: RankIdentity) -> Optional[str]:
        return _locate(rank.device).pci

    def can_set_mempolicy(self) -> bool:
        return _can_set_mempolicy()

    def probe(self, numactl_args: str) -> tuple[Optional[str], str]:
        return _probe_numactl_args(numactl_args, numactl=self.numactl_path or "numactl")

    def fail(self, node: Optional[int], reason: str) -> None:
        if self._report:
            _handle_numa_bind_failure(node, reason=reason)

    def cpu_counts(self) -> tuple[int, int]:
        import psutil

        return psutil.cpu_count(logical=False) or 0, psutil.cpu_count() or 0


def place_gpu_id(
    server_args: "ServerArgs",
    gpu: DeviceRef,
    *,
    launcher: Launcher,
    rank: Optional[RankIdentity] = None,
    report_failures: bool = True,
) -> ProcessPlacement:
    """Where the scheduler of device ``gpu`` runs on this host, and how.

    Args:
        server_args: ServerArgs, or any object with its fields placement reads.
        gpu: the rank's device in its launcher's numbering (upstream's ``gpu_id``).
        launcher: sglang's spawn, or a Ray actor.
        rank: the rank's tp/pp/dp ranks, for its label.
        report_failures: run the failure policy on each failed step (a WARNING, or
            an error under SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1); ``plan`` does not.

    Returns:
        The rank's placement.
    """
    policy = PlacementPolicy.from_env(server_args, launcher=launcher)
    rank = replace(rank or RankIdentity(), device=gpu)
    host = LiveHost(server_args, report_failures=report_failures)
    return resolve_placement(rank=rank, policy=policy, host=host)


def spawn_device(server_args: "ServerArgs", gpu_id: int) -> DeviceRef:
    """What a spawned rank's ``gpu_id`` counts: a CPU rank's index, else the CUDA or
    XPU index under the visibility variable it inherits."""
    cpu = getattr(server_args, "device", None) == "cpu"
    numbering = DeviceIndex.CPU_RANK if cpu else DeviceIndex.LOGICAL_GPU
    return DeviceRef(numbering, gpu_id)


def _node_choice(
    server_args: Optional["ServerArgs"], gpu: DeviceRef, node: Optional[int]
) -> NodeChoice:
    if node is not None:
        if isinstance(getattr(server_args, "numa_node", None), list):
            return NodeChoice(node, (f"node {node} from --numa-node ({gpu.label})",))
        via = "NVML's memory affinity, else its PCI device's numa_node in sysfs"
        return NodeChoice(node, (f"node {node}: {gpu.label}'s NUMA node ({via})",))
    spawned = gpu.numbering is DeviceIndex.LOGICAL_GPU
    if why := _why_numa_unavailable(numactl=spawned):
        return NodeChoice(None, (why,))
    why = f"no NUMA node found for {gpu.label}: {_locate(gpu).source}"
    return NodeChoice(None, (why,), degraded=True)


def _locate(gpu: DeviceRef):
    return locate_gpu(
        gpu, device=_gpu_device(), env=settings.device_env(), host=read_topology_cached
    )


# -- the spawn: configure_subprocess ---------------------------------------------------


@contextlib.contextmanager
def configure_subprocess(server_args: "ServerArgs", gpu_id: int) -> Iterator[None]:
    """Wrap ``Process.start()``: the scheduler spawned in the block starts under the
    placement of ``gpu_id``.

    Args:
        server_args: the engine's ServerArgs.
        gpu_id: the index sglang spawns the scheduler with (a CPU rank's index).

    Returns:
        A context manager. Where the placement is applied at the spawn, the block runs
        with a private numactl wrapper as the spawn executable, under a module lock
        (the data-parallel controller starts ranks from threads); the wrapper and its
        directory are removed once the child has started. A rank less bound than
        intended gets a WARNING, or an error under
        SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1, before anything starts.
    """
    policy = PlacementPolicy.from_env(server_args, launcher=Launcher.MP)
    if strategy_for(policy, located=True).in_child:  # V1: the child binds itself
        yield
        return
    with _SPAWN_LOCK:
        device = spawn_device(server_args, gpu_id)
        placement = place_gpu_id(server_args, device, launcher=Launcher.MP)
        logger.info(f"{device.label}: {placement.summary}")
        if placement.strategy is not Strategy.EXEC:
            yield
            return
        try:
            executable, debug_str = _create_numactl_executable(
                numactl_args=" ".join(placement.numactl_args),
                numactl=placement.numactl_path or "numactl",
            )
        except PlacementError as exc:
            _handle_numa_bind_failure(placement.numa_node, reason=str(exc))
            yield
            return
        debug_str += (
            f", logical_gpu_id={gpu_id}, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')}"
        )
        before = set(multiprocessing.active_children())
        try:
            with _mp_set_executable(executable=executable, debug_str=debug_str):
                yield
        finally:
            started = set(multiprocessing.active_children()) - before
            _remove_wrapper(executable, started)


def _create_numactl_executable(
    numactl_args: str, *, numactl: str = "numactl"
) -> tuple[str, str]:
    """A wrapper that execs the spawn's interpreter under ``numactl numactl_args``: in
    a private directory (0700), every word shell-quoted. Raises PlacementError naming
    TMPDIR where that directory cannot hold a program (a noexec mount)."""
    python = os.fsdecode(multiprocessing.spawn.get_executable())
    directory = tempfile.mkdtemp(prefix="sglang-numactl-")
    if os.statvfs(directory).f_flag & os.ST_NOEXEC:
        os.rmdir(directory)
        raise PlacementError(
            f"TMPDIR ({tempfile.gettempdir()}) is on a noexec mount, so the numactl "
            "wrapper of a spawned scheduler cannot run there; set TMPDIR to a "
            "directory where programs may run"
        )
    words = " ".join(map(shlex.quote, [numactl, *numactl_args.split(), python]))
    script = f'#!/bin/sh\nexec {words} "$@"\n'
    path = os.path.join(directory, "python")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    with open(os.open(path, flags, 0o700), "w") as file:
        file.write(script)
    return path, f"{script=}"


def _remove_wrapper(
    executable: str, started: Iterable[multiprocessing.Process]
) -> None:
    """Removes the wrapper's directory once each child started from it has left the
    shell (the shell reads the script after the spawn returns)."""
    shell = os.path.realpath("/bin/sh")
    deadline = time.monotonic() + _WRAPPER_WAIT_S
    for child in started:
        while time.monotonic() < deadline:
            try:
                if os.readlink(f"/proc/{child.pid}/exe") != shell:
                    break
            except OSError:  # it exited
                break
            time.sleep(0.001)
    shutil.rmtree(os.path.dirname(executable), ignore_errors=True)


@contextlib.contextmanager
def _mp_set_executable(executable: str, debug_str: str) -> Iterator[None]:
    old_executable = os.fsdecode(multiprocessing.spawn.get_executable())
    multiprocessing.spawn.set_executable(executable)
    logger.debug(f"mp.set_executable {old_executable} -> {executable} ({debug_str})")
    try:
        yield
    finally:
        seen = os.fsdecode(multiprocessing.spawn.get_executable())
        multiprocessing.spawn.set_executable(old_executable)
        logger.debug(f"mp.set_executable revert to {old_executable}")
    if seen != executable:
        raise PlacementError(
            f"the multiprocessing spawn executable changed from {executable} to {seen} "
            "inside configure_subprocess (another library called "
            "multiprocessing.set_executable): the scheduler may run unbound"
        )


# -- the rank itself: configure_scheduler_process -------------------------------------


def bind_scheduler_process(
    server_args: "ServerArgs", gpu_id: int
) -> Optional[BindOutcome]:
    """``configure_scheduler_process``'s placement step, in the rank: applies this
    rank's placement where its launcher could not, else leaves the launcher's binding.

    Args:
        server_args: the engine's ServerArgs.
        gpu_id: what ``configure_scheduler_process`` was given: a spawned rank's
            index, or a Ray actor's Ray GPU id.

    Returns:
        What was bound in this process (a Ray actor, the legacy V1 bind, upstream's
        NUMA-blind SGLANG_SET_CPU_AFFINITY slice where no node is known), or None.
    """
    launcher, gpu = launched_rank(server_args, gpu_id)
    policy = PlacementPolicy.from_env(server_args, launcher=launcher)
    host = LiveHost(server_args)
    rank = RankIdentity(gpu)
    choice = None
    if launcher is Launcher.MP and policy.bind_v2 and not policy.why_unplaced:
        # Placed at the spawn (its failures reported there): leave it as it is. Only
        # SGLANG_SET_CPU_AFFINITY's NUMA-blind slice, for a rank without a node, is
        # applied here.
        if not policy.set_cpu_affinity:
            return None
        if gpu.numbering is DeviceIndex.CPU_RANK:
            if settings.spawn_places_cpu_rank(policy.cpu_threads_bind, host.topology()):
                return None
        else:
            choice = host.numa_node(rank)
            if choice.node is not None:
                return None
    placement = resolve_placement(rank=rank, policy=policy, host=host, node=choice)
    if not placement.strategy.in_child:
        return None
    if placement.strategy is Strategy.V1:
        return numa_bind_to_node(placement.numa_node, placement=placement)
    return bind_in_process(placement)


def launched_rank(server_args: "ServerArgs", gpu_id: int) -> tuple[Launcher, DeviceRef]:
    """Who launched this scheduler process, and what its ``gpu_id`` counts: a Ray
    actor's is Ray's GPU id (not in Ray's narrowed CUDA_VISIBLE_DEVICES)."""
    ray_gpus = ray_actor_gpus()
    gpu = spawn_device(server_args, gpu_id)
    if ray_gpus is None:
        return Launcher.MP, gpu
    if ray_gpus and gpu.numbering is DeviceIndex.LOGICAL_GPU:
        gpu = DeviceRef(DeviceIndex.PHYSICAL_GPU, gpu_id)
    return Launcher.RAY, gpu


def ray_actor_gpus() -> Optional[list[str]]:
    """Ray's GPU ids when this process is a Ray actor, else None."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    if context.get_actor_id() is None:
        return None
    return [str(gpu) for gpu in context.get_accelerator_ids().get("GPU", [])]


# -- upstream's public helpers --------------------------------------------------------


def get_numa_node_if_available(server_args: "ServerArgs", gpu_id: int) -> Optional[int]:
    """The NUMA node of GPU ``gpu_id`` (its CUDA or XPU index): ``--numa-node`` first,
    else the node of the device it names under the ``CUDA_VISIBLE_DEVICES`` or
    ``ZE_AFFINITY_MASK`` in force; None when discovery is off, not possible here, or
    finds nothing."""
    return _gpu_numa_node(server_args, DeviceRef(DeviceIndex.LOGICAL_GPU, gpu_id))


def _gpu_numa_node(
    server_args: Optional["ServerArgs"], gpu: DeviceRef
) -> Optional[int]:
    numa_nodes = getattr(server_args, "numa_node", None)
    if numa_nodes is not None:
        return settings.listed_node(numa_nodes, gpu.index)
    if not settings.auto_numa_bind():
        return None
    if gpu.numbering is DeviceIndex.LOGICAL_GPU:
        if not _is_numa_available():
            return None
        nodes = _query_numa_node_for_gpu(gpu.index)
    else:  # a Ray actor binds itself: it needs no numactl
        if _why_numa_unavailable(numactl=False):
            return None
        nodes = _numa_nodes_of(gpu)
    if not nodes:
        return None
    if len(nodes) > 1:
        # Upstream's wording, which operators search for.
        logger.warning(
            f"Multiple NUMA nodes found for GPU {gpu.index}: {nodes}. "
            "Using the first one."
        )
    return nodes[0]


def get_libnuma() -> Optional[ctypes.CDLL]:
    """The loaded libnuma (a ``ctypes.CDLL``), or None when it cannot be loaded or the
    kernel refuses NUMA calls; placement's one loader answers."""
    from sglang.srt.placement.libnuma import load_libnuma

    lib = load_libnuma()
    return None if lib is None else lib.cdll


def numa_bind_to_node(
    node: int, *, placement: Optional[ProcessPlacement] = None
) -> Optional[BindOutcome]:
    """Bind the calling process to ``node``: its CPUs the current affinity allows (or
    the CPUs of ``placement``, the rank's V1 placement), and its memory as the
    preferred node where the memory policy may be set.

    As upstream, with two deliberate differences: every thread of the process is
    moved, not only the calling one, and the pages only this process maps migrate to
    the node. A missing libnuma, a node this host lacks, or a node whose CPUs the
    affinity excludes goes to the failure policy: a warning, or an error under
    SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1.
    """
    libnuma = get_libnuma()
    if libnuma is None or libnuma.numa_available() < 0:
        reason = "numa not available on this system, skip bind action"
        _handle_numa_bind_failure(node, reason=reason)
        return None
    if placement is None:
        legacy = PlacementPolicy(launcher=Launcher.MP, device="cuda", bind_v2=False)
        given = NodeChoice(node, (f"node {node} given to numa_bind_to_node",))
        host = LiveHost(None)
        placement = resolve_placement(
            rank=RankIdentity(), policy=legacy, host=host, node=given
        )
    if not placement.bound:
        return None
    if not placement.mem_nodes:
        _log_cpu_only_binding(node)
    return bind_in_process(placement)


def init_threads_binding(*, numa_index: int, world_size: int) -> str:
    """The CPUs of a CPU-device rank's OpenMP threads, from SGLANG_CPU_OMP_THREADS_BIND.

    With ``all`` (the default) rank ``numa_index`` gets one CPU per physical
    core of the ``numa_index``-th node with CPUs, as upstream, comma-separated;
    otherwise its ``|`` group as written. The group count bounds the index (a
    router runs each worker as an engine of one rank whose index counts across
    the setting). Groups may share CPUs, with a warning; ``plan`` reads the
    setting the same way.
    """
    from sglang.srt.placement.settings import rank_cpus, shared_cpus

    setting = settings.cpu_threads_bind()
    topology, affinity = read_topology_cached(), read_process_affinity()
    n_nodes = len(topology.cpu_nodes_within(affinity.cpus))  # as get_cpu_ids_by_node
    cpus = rank_cpus(setting, index=numa_index, topology=topology, affinity=affinity)
    if setting == "all":
        if world_size < n_nodes:
            logger.warning(
                f"Detected the current machine has {n_nodes} numa nodes available, but "
                f"the total number of ranks (dp_size * tp_size * pp_size) is "
                f"{world_size}, so only {world_size} numa nodes are used."
            )
        one_per_core = {min(core) for core in topology.cores_within(cpus)}
        local_omp_cpuid = ",".join(map(str, sorted(one_per_core)))
    else:
        local_omp_cpuid = setting.split("|")[numa_index].strip()
        if world_size > n_nodes:
            logger.warning(
                f"The total number of ranks ({world_size}) is larger than numa node "
                f"number ({n_nodes}), in this case the available memory amount of each "
                "rank cannot be determined in prior. Please set proper "
                "`--max-total-tokens` to avoid the out-of-memory error."
            )
        note = shared_cpus(setting, index=numa_index)
        if note is not None:
            logger.warning(note)
    logger.info(
        f"init_threads_binding: numa_index={numa_index}, world_size={world_size}, "
        f"local_omp_cpuid={local_omp_cpuid}"
    )
    return local_omp_cpuid


# -- upstream's private helpers -----------------------------------------------------


def _log_cpu_only_binding(node: int) -> None:
    logger.info(
        f"NUMA memory policy not permitted; binding CPUs only to NUMA node {node}. "
        "If using docker, --cap-add SYS_NICE also binds host memory."
    )


def _node_cpus(node: int) -> set:
    """The online CPUs of ``node`` (none without libnuma, for a node without CPUs, or
    one this host lacks), as sysfs lists them: what libnuma's numa_node_to_cpus reads.
    """
    if get_libnuma() is None:
        return set()
    found = read_topology_cached().node(node)
    return set(found.cpus) if found is not None else set()


def _numactl_cpu_mem_args(node: int, gpu_id: int) -> Optional[str]:
    """numactl's options for GPU ``gpu_id``'s rank on ``node``: the node's CPUs the
    affinity allows (with SGLANG_SET_CPU_AFFINITY=1 the rank's slice of them) and its
    memory; None, after the failure policy, when none is allowed."""
    policy = PlacementPolicy.from_env(None, launcher=Launcher.MP)
    rank = RankIdentity(DeviceRef(DeviceIndex.LOGICAL_GPU, gpu_id))
    share = gpu_share(node, rank=rank, policy=policy, host=LiveHost(None))
    if not share.cpus and _node_cpus(node):
        return None
    return cpu_mem_args(
        node=node, cpus=share.cpus, whole_node=share.whole, mem_nodes=[node]
    )


def _strip_memory_args(numactl_args: str) -> str:
    """``numactl_args`` without ``--membind``: the CPU binding only."""
    return strip_memory_args(numactl_args)


def _probe_numactl_args(
    numactl_args: str, *, numactl: str = "numactl"
) -> tuple[Optional[str], str]:
    """The strongest of ``numactl_args``, its ``--preferred`` form and its CPU binding
    alone that ``numactl ... true`` runs: the one memory-policy ladder of a spawn.

    A binding numactl refuses would kill the rank before Python starts, with no
    traceback; ``_can_set_mempolicy`` reads the policy only, which misses a seccomp
    profile denying ``set_mempolicy`` or a cpuset refusing ``--membind``.

    Returns ``(args, stderr)``: the first accepted option set and "", or None and
    numactl's complaint about the last one tried.
    """

    def attempt(args: str) -> tuple[bool, str]:
        try:
            done = subprocess.run(
                [numactl, *args.split(), "true"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                timeout=_PROBE_TIMEOUT_S,
            )
        except Exception as exc:  # missing numactl, timeout: this binding fails
            logger.debug(f"numactl probe for {args!r} failed: {exc}")
            return False, str(exc)
        err = done.stderr.decode("utf-8", errors="replace").strip()
        if done.returncode != 0:
            logger.debug(f"numactl probe for {args!r} rejected: {err!r}")
        return done.returncode == 0, err

    ok, first_err = attempt(numactl_args)
    if ok:
        return numactl_args, ""
    why = f": {first_err}" if first_err else ""
    last_err = first_err
    if "--membind=" in numactl_args:
        preferred = numactl_args.replace("--membind=", "--preferred=")
        if attempt(preferred)[0]:
            logger.warning(
                f"numactl rejected hard memory binding ({numactl_args!r}){why}; "
                f"falling back to soft preferred policy ({preferred!r})."
            )
            return preferred, ""
    cpu_only = _strip_memory_args(numactl_args)
    if cpu_only and cpu_only != numactl_args:
        ok, last_err = attempt(cpu_only)
        if ok:
            logger.warning(
                f"numactl rejected memory binding ({numactl_args!r}){why}; "
                f"falling back to CPU-only binding ({cpu_only!r})."
            )
            return cpu_only, ""
    return None, last_err


def _handle_numa_bind_failure(
    node: Optional[int],
    allowed_cpus: Optional[Iterable[int]] = None,
    gpu_id: Optional[int] = None,
    *,
    reason: Optional[str] = None,
) -> None:
    """Upstream's failure policy: warn, or raise (``RuntimeError``) under
    SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1.

    Without ``reason`` the failure is an empty CPU intersection and the message
    names ``allowed_cpus``, in upstream's words.
    """
    if reason is None:
        for_gpu = f" for GPU {gpu_id}" if gpu_id is not None else ""
        reason = (
            f"NUMA node {node} has no CPU cores allowed by the current affinity "
            f"{sorted(allowed_cpus or ())}, skipping NUMA binding{for_gpu}."
        )
    handle_bind_failure(reason, log=logger)


def _can_set_mempolicy() -> bool:
    """Whether this process may use the memory-policy calls (a container without
    SYS_NICE may not)."""
    from sglang.srt.placement.libnuma import read_mempolicy

    try:
        read_mempolicy()
    except OSError:
        return False
    return True


def _is_numa_available() -> bool:
    """Upstream's preconditions for discovery: a CUDA or XPU platform, a node 1, and
    numactl for the V2 path. A host where only CPU affinity can be set (a container
    without SYS_NICE) counts."""
    return _why_numa_unavailable() is None


def _why_numa_unavailable(*, numactl: bool = True) -> Optional[str]:
    from sglang.srt.placement import topology

    if not (_platform_flag("_is_cuda") or _platform_flag("_is_xpu")):
        return "not a CUDA or XPU platform: no GPU NUMA node to find"
    if not os.path.isdir(
        os.path.join(topology.SYSFS_ROOT, "devices/system/node/node1")
    ):
        return "this host has one NUMA node: node binding cannot help"
    if numactl and not shutil.which("numactl") and settings.bind_v2():
        logger.debug(
            "numactl command not found, skipping NUMA node configuration for GPU. "
            "Install numactl "
            "(e.g., apt-get install numactl) to enable automatic NUMA binding."
        )
        return _NO_NUMACTL
    return None


def _query_numa_node_for_gpu(device_id: int) -> list[int]:
    """The NUMA node(s) of logical device ``device_id`` (after CUDA_VISIBLE_DEVICES /
    ZE_AFFINITY_MASK): NVML's memory affinity where NVML answers, else the node of its
    PCI device in sysfs."""
    return _numa_nodes_of(DeviceRef(DeviceIndex.LOGICAL_GPU, device_id))


def _numa_nodes_of(gpu: DeviceRef) -> list[int]:
    found = _locate(gpu)
    if not found.nodes:
        logger.warning(
            f"{gpu.label}: no NUMA node ({found.source}), skipping NUMA node "
            "configuration for GPU"
        )
    return list(found.nodes)
