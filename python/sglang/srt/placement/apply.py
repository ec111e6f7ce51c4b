"""Apply a placement to the running process: the in-process strategy and the legacy V1 bind.

``bind_in_process`` is for launchers that cannot start a rank under numactl. It
binds every thread already running (a pool started by an import would otherwise
stay unbound), sets the memory policy, and migrates the pages touched so far to
the target node, since late binding otherwise leaves most of them where the
process started.

The memory policy is a per-thread attribute that only the thread itself can
set: it holds for the calling thread and for threads it starts afterwards.
Threads that were already running keep their own policy, but with their CPUs
moved to the target node their first-touch allocations land there too. Call
this first thing in the rank, from its main thread.
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from sglang.srt.placement import settings
from sglang.srt.placement.cpulist import format_cpulist
from sglang.srt.placement.libnuma import LibNumaApi, load_libnuma, read_mempolicy
from sglang.srt.placement.types import (
    MemPolicy,
    PlacementError,
    ProcessPlacement,
    Strategy,
)

logger = logging.getLogger(__name__)

_MAX_THREAD_PASSES = 5


@dataclass(frozen=True)
class BindOutcome:
    """What ``bind_in_process`` applied to one rank, and what it could not."""

    label: str
    cpus: frozenset[int]
    """CPU affinity set on the process's threads; empty when affinity was left alone."""
    threads: int
    """Threads whose affinity was set."""
    mem_policy: str
    """Memory policy in force afterwards: "bind", "preferred" or "none" (left alone or not settable)."""
    mem_nodes: frozenset[int]
    """Nodes of that policy."""
    pages_not_migrated: Optional[int]
    """Pages the kernel could not move to the target node; None when no migration was attempted."""
    notes: tuple[str, ...] = ()
    """Each step that was skipped or degraded, and why."""

    @property
    def degraded(self) -> bool:
        return bool(self.notes)

    @property
    def summary(self) -> str:
        parts: list[str] = []
        if self.cpus:
            parts.append(
                f"cpus {format_cpulist(self.cpus)} on {self.threads} thread(s)"
            )
        else:
            parts.append("cpus unchanged")
        if self.mem_policy == MemPolicy.NONE:
            parts.append("memory policy unchanged")
        else:
            parts.append(
                f"memory {self.mem_policy} on node(s) {format_cpulist(self.mem_nodes)}"
            )
        if self.pages_not_migrated is not None:
            parts.append(f"pages migrated ({self.pages_not_migrated} not moved)")
        text = f"{self.label}: " + ", ".join(parts)
        if self.notes:
            text += "; " + "; ".join(self.notes)
        return text


def bind_in_process(
    placement: ProcessPlacement,
    *,
    libnuma: Optional[LibNumaApi] = None,
    tasks_dir: str = "/proc/self/task",
    setaffinity: Callable[[int, Iterable[int]], None] = os.sched_setaffinity,
    migrate: bool = True,
) -> BindOutcome:
    """Bind this running process to ``placement``: every thread's CPUs, the memory policy, touched pages.

    Degrades like numactl's ladder (bind -> preferred -> CPU only) and says so in the
    outcome; with SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1 any such step raises PlacementError.
    ``libnuma``, ``tasks_dir`` and ``setaffinity`` are seams for tests.
    """
    label = placement.label
    if placement.strategy == Strategy.NONE:
        why = "; ".join(placement.reasons) or "placement strategy is none"
        outcome = BindOutcome(
            label, frozenset(), 0, "none", frozenset(), None, (f"not bound: {why}",)
        )
        logger.info(outcome.summary)
        return outcome

    notes: list[str] = []

    def degrade(what: str) -> None:
        handle_bind_failure(
            f"{label}: {what}",
            fatal_hint=". SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1 makes this fatal; fix "
            "the cause, or unset it to run with the weaker binding.",
        )
        notes.append(what)

    lib: Optional[LibNumaApi] = None
    if placement.mem_policy != MemPolicy.NONE:
        lib = libnuma if libnuma is not None else load_libnuma()
        if lib is None:
            degrade(
                "memory policy not set: libnuma.so.1 is not available (install libnuma1)"
            )

    cpus, threads = frozenset(), 0
    if placement.cpus:
        refused: Optional[ThreadAffinityError] = None
        try:
            threads = set_all_threads_affinity(
                placement.cpus, tasks_dir=tasks_dir, setaffinity=setaffinity
            )
        except ThreadAffinityError as exc:
            threads, refused = exc.threads_set, exc
        if refused is None:
            cpus = placement.cpus
        else:
            degrade(
                f"cpu affinity {format_cpulist(placement.cpus)} not applied ({refused.strerror}); "
                f"the CPUs may be offline or outside this process's cpuset"
            )

    mem_policy, mem_nodes = "none", frozenset()
    if lib is not None:
        mem_policy, mem_nodes = _set_memory_policy(placement, lib, degrade)

    pages_not_migrated: Optional[int] = None
    if lib is not None and mem_nodes and migrate:
        sources = lib.configured_nodes() - mem_nodes
        if sources:
            try:
                pages_not_migrated = lib.migrate_pages(0, sources, mem_nodes)
            except OSError as exc:
                degrade(f"pages touched before binding stay where they are: {exc}")
        else:
            pages_not_migrated = 0

    outcome = BindOutcome(
        label, cpus, threads, mem_policy, mem_nodes, pages_not_migrated, tuple(notes)
    )
    logger.info(outcome.summary)
    return outcome


class ThreadAffinityError(OSError):
    """The kernel refused one thread's CPU affinity; ``threads_set`` threads had been moved before it."""

    def __init__(self, cause: OSError, *, tid: int, threads_set: int) -> None:
        super().__init__(cause.errno, f"thread {tid}: {cause.strerror or cause}")
        self.tid = tid
        self.threads_set = threads_set


def set_all_threads_affinity(
    cpus: frozenset[int],
    *,
    tasks_dir: str = "/proc/self/task",
    setaffinity: Callable[[int, Iterable[int]], None] = os.sched_setaffinity,
) -> int:
    """Set the CPU affinity of every thread of this process to ``cpus``; returns how many threads were set.

    Threads started later inherit it from their creator. A thread started during the
    walk by a thread not yet moved would keep the old CPUs, so the directory is
    listed again until a pass finds no new thread. Threads that exit during the walk
    are skipped; any other refusal raises :class:`ThreadAffinityError` (an OSError).
    ``tasks_dir`` and ``setaffinity`` are seams for tests.
    """
    tried: set[int] = set()
    bound = 0
    for _ in range(_MAX_THREAD_PASSES):
        pending = sorted(set(_list_tids(tasks_dir)) - tried)
        if not pending:
            break
        for tid in pending:
            tried.add(tid)
            try:
                setaffinity(tid, cpus)
            except ProcessLookupError:
                pass  # the thread exited after the listing
            except OSError as exc:
                raise ThreadAffinityError(exc, tid=tid, threads_set=bound) from exc
            else:
                bound += 1
    return bound


def _list_tids(tasks_dir: str) -> list[int]:
    return [int(name) for name in os.listdir(tasks_dir) if name.isdigit()]


def _set_memory_policy(
    placement: ProcessPlacement,
    lib: LibNumaApi,
    degrade: Callable[[str], None],
) -> tuple[str, frozenset[int]]:
    preferred_node = placement.numa_node
    if preferred_node is None and placement.mem_nodes:
        preferred_node = min(placement.mem_nodes)

    if placement.mem_policy == MemPolicy.BIND:
        try:
            lib.set_membind(placement.mem_nodes)
            return "bind", placement.mem_nodes
        except OSError as exc:
            if preferred_node is None:
                degrade(
                    f"membind to {_nodes(placement.mem_nodes)} rejected by the kernel ({_err(exc)})"
                )
                return "none", frozenset()
            degrade(
                f"membind to {_nodes(placement.mem_nodes)} rejected by the kernel ({_err(exc)}): "
                f"falling back to preferred node {preferred_node}"
            )

    if preferred_node is None:
        degrade("memory policy not set: the placement names no NUMA node")
        return "none", frozenset()
    try:
        lib.set_preferred(preferred_node)
        return "preferred", frozenset([preferred_node])
    except OSError as exc:
        degrade(
            f"preferred node {preferred_node} rejected by the kernel ({_err(exc)}): CPU binding only"
        )
        return "none", frozenset()


def _nodes(nodes: Iterable[int]) -> str:
    ordered = sorted(set(nodes))
    return ("node " if len(ordered) == 1 else "nodes ") + format_cpulist(ordered)


def _err(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "")
    text = exc.strerror or str(exc)
    return f"{name} {text}".strip()


def handle_bind_failure(
    message: str, *, log: logging.Logger = logger, fatal_hint: str = ""
) -> None:
    """The one failure policy, upstream's: a rank less bound than intended is a warning
    (on ``log``, naming the rank), or under SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1 an error
    raised before the rank runs, so an operator who asked for strictness never gets a
    silently slower rank."""
    log.warning(message)
    if settings.bind_failure_is_fatal():
        raise PlacementError(message + fatal_hint)


def can_set_mempolicy() -> bool:
    """Whether this process may use the memory-policy syscalls (a container without SYS_NICE may not)."""
    try:
        read_mempolicy()
    except OSError:
        return False
    return True
