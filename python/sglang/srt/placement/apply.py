"""The one failure policy, and the one in-process bind: for a Ray actor, the legacy V1
bind and upstream's ``numa_bind_to_node``. Every thread moves (an import's pool would
stay unbound) and the pages this process alone maps migrate (a late bind leaves them in
place; shared pages stay where they are); the memory policy holds for the caller and
the threads it starts: bind first."""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional

from sglang.srt.placement import settings
from sglang.srt.placement.cpulist import format_cpulist
from sglang.srt.placement.libnuma import (
    MPOL_BIND,
    MPOL_PREFERRED,
    LibNuma,
    load_libnuma,
)
from sglang.srt.placement.types import (
    MemPolicy,
    PlacementError,
    ProcessPlacement,
    descend,
)

logger = logging.getLogger(__name__)

TASKS_DIR = "/proc/self/task"
_MAX_THREAD_PASSES = 5
_CRASH_HINT = ". Fix it, or unset SGLANG_CRASH_ON_NUMA_BIND_FAILURE to run less bound."


def handle_bind_failure(
    message: str, *, log: logging.Logger = logger, fatal_hint: str = ""
) -> None:
    """Upstream's: a warning, or under SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1 an error
    raised before the rank runs, so strictness never yields a silently slower rank."""
    log.warning(message)
    if settings.bind_failure_is_fatal():
        raise PlacementError(message + fatal_hint)


@dataclass(frozen=True)
class BindOutcome:
    placement: ProcessPlacement
    cpus: frozenset[int]  # empty when the affinity was left alone
    threads: int
    mem_policy: MemPolicy
    mem_nodes: frozenset[int]
    mappings_not_moved: Optional[int]  # None when no migration was attempted
    notes: tuple[str, ...] = ()  # empty when nothing was lost

    @property
    def summary(self) -> str:
        cpus = f"cpus {format_cpulist(self.cpus)} on {self.threads} thread(s)"
        memory = f"memory {self.mem_policy} on node(s) {format_cpulist(self.mem_nodes)}"
        parts = [cpus if self.cpus else "cpus unchanged"]
        parts.append(memory if self.mem_nodes else "memory policy unchanged")
        if self.mappings_not_moved is not None:
            moved = f"{self.mappings_not_moved} mapping(s) not moved"
            parts.append(f"private pages migrated ({moved})")
        return f"{self.placement.label}: " + "; ".join([", ".join(parts), *self.notes])


def bind_in_process(placement: ProcessPlacement) -> BindOutcome:
    """Binds this process, every thread, as ``placement`` says.

    Args:
        placement: a placement whose strategy is applied in the process (in-process,
            V1 or cpu-affinity); an unbound one changes nothing.

    Returns:
        What was applied. The memory policy degrades down the ladder (bind,
        preferred, CPUs only); each lost step is a WARNING and a note, or a
        PlacementError under SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1.
    """
    notes: list[str] = []

    def degrade(what: str) -> None:
        handle_bind_failure(f"{placement.label}: {what}", fatal_hint=_CRASH_HINT)
        notes.append(what)

    cpus, threads, policy, nodes, not_moved = frozenset(), 0, MemPolicy.NONE, (), None
    if not placement.bound:
        notes.append(f"not bound: {'; '.join(placement.reasons) or 'no strategy'}")
    else:
        lib = load_libnuma() if placement.mem_policy != MemPolicy.NONE else None
        if placement.mem_policy != MemPolicy.NONE and lib is None:
            missing = "libnuma.so.1 is not available (install libnuma1)"
            degrade(f"memory policy not set: {missing}")
        if placement.cpus:
            threads, refusal = set_all_threads_affinity(placement.cpus)
            if refusal is None:
                cpus = placement.cpus
            else:
                degrade(
                    f"cpu affinity {format_cpulist(placement.cpus)} not applied "
                    f"({refusal}); the CPUs may be offline or outside this process's "
                    "cpuset"
                )
        if lib is not None:
            policy, nodes = _set_memory_policy(placement, lib, degrade)
        if lib is not None and nodes:
            mode = MPOL_BIND if policy is MemPolicy.BIND else MPOL_PREFERRED
            try:
                not_moved = lib.move_private_pages(mode, nodes)
            except OSError as exc:
                degrade(f"pages touched before binding stay where they are: {exc}")
    outcome = BindOutcome(
        placement, cpus, threads, policy, frozenset(nodes), not_moved, (*notes,)
    )
    logger.info(outcome.summary)
    return outcome


def set_all_threads_affinity(cpus: frozenset[int]) -> tuple[int, Optional[str]]:
    """(threads moved, the refusal that stopped it). A thread started by one not yet
    moved keeps the old CPUs, so the threads are listed again until none is new."""
    tried: set[int] = set()
    moved = 0
    for _ in range(_MAX_THREAD_PASSES):
        listed = {int(name) for name in os.listdir(TASKS_DIR) if name.isdigit()}
        if not listed - tried:
            break
        for tid in sorted(listed - tried):
            tried.add(tid)
            try:
                os.sched_setaffinity(tid, cpus)
                moved += 1
            except ProcessLookupError:
                pass  # the thread exited after the listing
            except OSError as exc:
                return moved, f"thread {tid}: {exc.strerror or exc}"
    return moved, None


def _set_memory_policy(
    placement: ProcessPlacement, lib: LibNuma, degrade: Callable[[str], None]
) -> tuple[MemPolicy, frozenset[int]]:
    # A bound placement always names its node, which its memory nodes hold.
    nodes, node = placement.mem_nodes, placement.numa_node
    where = ("node " if len(nodes) == 1 else "nodes ") + format_cpulist(nodes)

    def attempt(policy: MemPolicy) -> Optional[str]:
        try:
            if policy is MemPolicy.BIND:
                lib.set_membind(nodes)
            elif policy is MemPolicy.PREFERRED:
                lib.set_preferred(node)
            return None  # accepted (NONE leaves the policy alone)
        except OSError as exc:
            why = f"{errno.errorcode.get(exc.errno or 0, '')} {exc.strerror or exc}"
        if policy is MemPolicy.BIND:
            lost, now = f"membind to {where}", f"falling back to preferred node {node}"
        else:
            lost, now = f"preferred node {node}", "CPU binding only"
        # Under the crash setting this raises: nothing weaker is tried.
        degrade(f"{lost} rejected by the kernel ({why.strip()}): {now}")
        return why

    got, _ = descend(placement.mem_policy, attempt)
    kept = {MemPolicy.BIND: nodes, MemPolicy.PREFERRED: frozenset([node])}
    return got, kept.get(got, frozenset())
