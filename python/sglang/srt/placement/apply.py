"""The one failure policy, and the in-process bind for launchers that cannot exec a
rank under numactl. Every running thread is moved (an import's pool would stay
unbound) and touched pages migrate (late binding leaves them where they are); the
memory policy holds for the calling thread and those it starts: bind first thing."""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from sglang.srt.placement import settings
from sglang.srt.placement.cpulist import format_cpulist
from sglang.srt.placement.libnuma import LibNuma, load_libnuma
from sglang.srt.placement.types import (
    MemPolicy,
    PlacementError,
    ProcessPlacement,
    Strategy,
)

logger = logging.getLogger(__name__)

_MAX_THREAD_PASSES = 5
_CRASH_HINT = (
    ". SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1 makes this fatal; fix the cause, or "
    "unset it to run with the weaker binding."
)


def handle_bind_failure(
    message: str, *, log: logging.Logger = logger, fatal_hint: str = ""
) -> None:
    """Upstream's: a warning, or under SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1 an error
    raised before the rank runs, so strictness never yields a silently slower rank."""
    log.warning(message)
    if settings.bind_failure_is_fatal():
        raise PlacementError(message + fatal_hint)


def enforce_failure_policy(
    placement: ProcessPlacement, *, who: str, log: logging.Logger = logger
) -> None:
    """Before anything is applied: a rank never runs less bound than planned unseen."""
    reasons = "; ".join(placement.reasons)
    if placement.warning:
        weaker = f"bound less tightly than planned: {reasons}"
        unbound = f"{reasons}; skipping NUMA binding for {who}."
        message = f"{who}: {weaker if placement.bound else unbound}"
        handle_bind_failure(message, log=log)


@dataclass(frozen=True)
class BindOutcome:
    label: str
    cpus: frozenset[int]  # empty when the affinity was left alone
    threads: int
    mem_policy: str  # "bind", "preferred" or "none"
    mem_nodes: frozenset[int]
    pages_not_migrated: Optional[int]  # None when no migration was attempted
    notes: tuple[str, ...] = ()  # empty when nothing was lost

    @property
    def summary(self) -> str:
        cpus = f"cpus {format_cpulist(self.cpus)} on {self.threads} thread(s)"
        memory = f"memory {self.mem_policy} on node(s) {format_cpulist(self.mem_nodes)}"
        parts = [cpus if self.cpus else "cpus unchanged"]
        parts.append(memory if self.mem_nodes else "memory policy unchanged")
        if self.pages_not_migrated is not None:
            parts.append(f"pages migrated ({self.pages_not_migrated} not moved)")
        return f"{self.label}: " + "; ".join([", ".join(parts), *self.notes])


def bind_in_process(
    placement: ProcessPlacement,
    *,
    libnuma: Optional[LibNuma] = None,
    tasks_dir: str = "/proc/self/task",
    setaffinity: Callable[[int, Iterable[int]], None] = os.sched_setaffinity,
    migrate: bool = True,
) -> BindOutcome:
    """Degrades like numactl's ladder (bind, preferred, CPUs only); each lost step is
    a note, or a PlacementError under the crash setting. ``migrate=False`` lets a
    benchmark measure what migration buys."""
    notes: list[str] = []
    cpus, threads, policy, nodes, not_moved = frozenset(), 0, "none", frozenset(), None

    def degrade(what: str) -> None:
        handle_bind_failure(f"{placement.label}: {what}", fatal_hint=_CRASH_HINT)
        notes.append(what)

    if placement.strategy == Strategy.NONE:
        why = "; ".join(placement.reasons) or "placement strategy is none"
        notes.append(f"not bound: {why}")
    else:
        wants_memory = placement.mem_policy != MemPolicy.NONE
        lib = (libnuma or load_libnuma()) if wants_memory else None
        if wants_memory and lib is None:
            missing = "libnuma.so.1 is not available (install libnuma1)"
            degrade(f"memory policy not set: {missing}")
        if placement.cpus:
            threads, refusal = set_all_threads_affinity(
                placement.cpus, tasks_dir=tasks_dir, setaffinity=setaffinity
            )
            if refusal is None:
                cpus = placement.cpus
            else:
                degrade(
                    f"cpu affinity {format_cpulist(placement.cpus)} not applied "
                    f"({refusal}); the CPUs may be offline or outside this "
                    "process's cpuset"
                )
        if lib is not None:
            policy, nodes = _set_memory_policy(placement, lib, degrade)
        if lib is not None and nodes and migrate:
            try:
                not_moved = lib.migrate_pages(0, lib.configured_nodes() - nodes, nodes)
            except OSError as exc:
                degrade(f"pages touched before binding stay where they are: {exc}")
    outcome = BindOutcome(
        placement.label, cpus, threads, policy, nodes, not_moved, tuple(notes)
    )
    logger.info(outcome.summary)
    return outcome


def set_all_threads_affinity(
    cpus: frozenset[int],
    *,
    tasks_dir: str = "/proc/self/task",
    setaffinity: Callable[[int, Iterable[int]], None] = os.sched_setaffinity,
) -> tuple[int, Optional[str]]:
    """(threads moved, the refusal that stopped it). A thread started by one not yet
    moved keeps the old CPUs, so the threads are listed again until none is new."""
    tried: set[int] = set()
    moved = 0
    for _ in range(_MAX_THREAD_PASSES):
        listed = {int(name) for name in os.listdir(tasks_dir) if name.isdigit()}
        if not listed - tried:
            break
        for tid in sorted(listed - tried):
            tried.add(tid)
            try:
                setaffinity(tid, cpus)
                moved += 1
            except ProcessLookupError:
                pass  # the thread exited after the listing
            except OSError as exc:
                return moved, f"thread {tid}: {exc.strerror or exc}"
    return moved, None


def _set_memory_policy(
    placement: ProcessPlacement, lib: LibNuma, degrade: Callable[[str], None]
) -> tuple[str, frozenset[int]]:
    # A bound placement always names its node, which its memory nodes hold.
    nodes, preferred = placement.mem_nodes, placement.numa_node
    if placement.mem_policy == MemPolicy.BIND:
        try:
            lib.set_membind(nodes)
            return "bind", nodes
        except OSError as exc:
            where = ("node " if len(nodes) == 1 else "nodes ") + format_cpulist(nodes)
            degrade(
                f"membind to {where} rejected by the kernel ({_err(exc)}): falling "
                f"back to preferred node {preferred}"
            )
    try:
        lib.set_preferred(preferred)
        return "preferred", frozenset([preferred])
    except OSError as exc:
        degrade(
            f"preferred node {preferred} rejected by the kernel ({_err(exc)}): "
            "CPU binding only"
        )
        return "none", frozenset()


def _err(exc: OSError) -> str:
    return f"{errno.errorcode.get(exc.errno or 0, '')} {exc.strerror or exc}".strip()
