"""Inside a rank: apply the part of its placement that is done there, and read the binding back.

A Ray scheduler actor binds itself in-process when it could not start under
numactl, then reads its binding back (every thread included) and compares it
with its placement: a difference is a warning naming the rank, or an error
under SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Callable, Optional

from sglang.srt.placement import settings
from sglang.srt.placement.cpulist import format_cpulist, parse_cpulist
from sglang.srt.placement.types import PlacementError, ProcessPlacement, Strategy

if TYPE_CHECKING:
    from sglang.srt.placement.apply import BindOutcome

logger = logging.getLogger(__name__)

# Only these strategies promise that every thread runs on ``placement.cpus``.
_THREAD_CHECKED_STRATEGIES = ("exec", "in-process")


def apply_in_rank(placement: ProcessPlacement, *, who: str) -> Optional["BindOutcome"]:
    """Apply the part of ``placement`` that is done inside the rank (in-process); log what holds.

    Returns what an in-process bind applied (None for other strategies).
    """
    summary = (
        f"node={placement.numa_node} cpus={format_cpulist(placement.cpus) or '-'} "
        f"mem={placement.mem_policy}:{format_cpulist(placement.mem_nodes) or '-'} strategy={placement.strategy}"
    )
    if placement.strategy == Strategy.IN_PROCESS:
        from sglang.srt.placement.apply import bind_in_process

        outcome = bind_in_process(placement)
        logger.info(f"{who}: bound in-process: {summary}")
        return outcome
    if placement.strategy == Strategy.EXEC:
        logger.info(
            f"{who}: started under numactl {' '.join(placement.numactl_args)}: {summary}"
        )
    else:
        logger.info(
            f"{who}: not bound ({'; '.join(placement.reasons) or 'no reason recorded'})"
        )
    return None


def _thread_cpus(tasks_dir: str) -> dict[int, frozenset[int]]:
    found: dict[int, frozenset[int]] = {}
    for name in os.listdir(tasks_dir):
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(tasks_dir, name, "status"), encoding="ascii") as f:
                text = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread exited after the listing
        for line in text.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                found[int(name)] = parse_cpulist(line.split(":", 1)[1].strip())
                break
    return found


def thread_mismatches(
    placement: ProcessPlacement, *, tasks_dir: str = "/proc/self/task"
) -> list[str]:
    """One line when some thread of this process may run outside ``placement.cpus``.

    ``/proc/self/status`` shows the main thread only; a process bound from one
    thread keeps its other threads (and their allocations) unbound.
    """
    if placement.strategy not in _THREAD_CHECKED_STRATEGIES or not placement.cpus:
        return []
    threads = _thread_cpus(tasks_dir)
    off = {tid: cpus for tid, cpus in threads.items() if cpus != placement.cpus}
    if not off:
        return []
    tid, cpus = sorted(off.items())[0]
    return [
        f"{len(off)} of {len(threads)} threads may run outside the planned CPUs "
        f"(thread {tid}: cpus {format_cpulist(cpus) or '(none)'}, planned {format_cpulist(placement.cpus)})"
    ]


def read_back(placement: ProcessPlacement) -> dict[str, Any]:
    """Read this process's binding back and list every way it differs from ``placement``."""
    from sglang.srt.placement.observe import compare_binding, observe_self

    observed = observe_self()
    mismatches = [*compare_binding(placement, observed), *thread_mismatches(placement)]
    return {
        "pid": os.getpid(),
        "observed": observed.to_dict(),
        "threads": len(os.listdir("/proc/self/task")),
        "mismatches": mismatches,
    }


def report_mismatches(
    placement: ProcessPlacement,
    report: dict[str, Any],
    *,
    who: str,
    warn: Callable[[str], None],
) -> None:
    """Log a rank whose binding differs from its placement; raise instead under SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1."""
    mismatches = report.get("mismatches") or []
    if not mismatches:
        return
    message = (
        f"{who}: scheduler (pid {report.get('pid', os.getpid())}) is not where its placement says "
        f"(strategy {placement.strategy}): {'; '.join(mismatches)}"
    )
    if settings.bind_failure_is_fatal():
        raise PlacementError(
            f"{message}. SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1 makes this fatal; fix the cause, or unset it "
            f"to run with a warning."
        )
    warn(message)
