"""What both launchers share: the rank's report types, the exec decision, the readiness check and the read-back.

A launcher starts a rank under its placement; these are the pieces whose
answer must not depend on which launcher asked: when ``exec`` is demoted to
``in-process`` and why, the numactl argv or the reason it cannot run, what a
ready rank reports, and how a rank reads its own binding back and compares it
with its placement.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence, TypeVar

from sglang.srt.placement import settings
from sglang.srt.placement.cpulist import format_cpulist, parse_cpulist
from sglang.srt.placement.types import PlacementError, ProcessPlacement, RankIdentity, Strategy

DEFAULT_TIMEOUT_S = 600.0

T = TypeVar("T")

# Only these strategies promise that every thread runs on ``placement.cpus``.
_THREAD_CHECKED_STRATEGIES = ("exec", "in-process")


@dataclass(frozen=True)
class RankResult:
    """One rank that reported readiness: where it was placed, who it is, and what it reported."""

    placement: Optional[ProcessPlacement]
    rank: RankIdentity
    info: dict = field(default_factory=dict)
    binding: dict = field(default_factory=dict)
    """What the rank read back after applying its placement (``read_back``: pid, observed, mismatches); {} if not read."""


class RankLaunchError(RuntimeError):
    """A scheduler rank failed to start or to finish; the message names the rank and carries its traceback."""

    def __init__(self, message: str, *, label: str = "", error: str = "", child_traceback: str = "") -> None:
        super().__init__(message)
        self.label = label
        self.error = error
        self.child_traceback = child_traceback


# --------------------------------------------------------------------------- the exec decision


def demote_to_in_process(placement: ProcessPlacement, *, why: str) -> ProcessPlacement:
    """``placement`` with strategy in-process instead of exec, ``why`` appended to its reasons."""
    reason = f"{why}: in-process bind with libnuma"
    return placement.replace(strategy=Strategy.IN_PROCESS, numactl_args=(), reasons=(*placement.reasons, reason))


@dataclass(frozen=True)
class ExecCommand:
    """The argv that starts a rank under numactl ([numactl, *options, python]), or why it cannot."""

    argv: Optional[tuple[str, ...]]
    refusal: Optional[str] = None
    """Why there is no argv: numactl is missing, or numactl's own complaint about the options."""
    numactl_missing: bool = False

    @property
    def prefix(self) -> Optional[tuple[str, ...]]:
        """The argv without the Python interpreter (what goes in front of a spawned child's command)."""
        return None if self.argv is None else self.argv[:-1]


def exec_command(placement: ProcessPlacement, *, python: str) -> ExecCommand:
    """The numactl argv for an exec ``placement`` on this host, checked by numactl's own dry run (cached)."""
    from sglang.srt.placement.numactl import exec_refusal, numactl_prefix

    try:
        prefix = numactl_prefix(placement)
    except FileNotFoundError as exc:
        return ExecCommand(argv=None, refusal=f"numactl was not found at launch ({exc})", numactl_missing=True)
    complaint = exec_refusal(placement)
    if complaint is not None:
        return ExecCommand(argv=None, refusal=complaint)
    return ExecCommand(argv=(*prefix, python))


def decide_start(placement: ProcessPlacement, command: Optional[ExecCommand], *,
                 log: Callable[[str], None]) -> ProcessPlacement:
    """The placement a rank starts with: exec stays exec when ``command`` has an argv, else it is demoted.

    Under SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1 a refused exec is an error rather
    than a demotion, since the rank would not start the way it was planned.
    """
    if placement.strategy != Strategy.EXEC or (command is not None and command.argv is not None):
        return placement
    why = command.refusal if command is not None else "the launcher was asked to bind in-process"
    if command is not None and settings.bind_failure_is_fatal():
        raise PlacementError(f"{placement.label}: {why} (SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1)")
    if command is not None:
        log(f"{placement.label}: {why}; binding in-process instead")
    return demote_to_in_process(placement, why=why)


def numactl_complaint(prefix: Sequence[str]) -> Optional[str]:
    """numactl's own complaint for ``prefix``, by running it again in front of ``true``; None if it now works."""
    from sglang.srt.placement.numactl import run_numactl

    result = run_numactl([*prefix, shutil.which("true") or "/bin/true"])
    return None if result.ok else result.message


# --------------------------------------------------------------------------- readiness


def ready_info_of(scheduler: Any) -> dict:
    """What a started rank reports: its target's ``ready_info()``, checked to be a JSON-serialisable dict."""
    ready_info = getattr(scheduler, "ready_info", None)
    info = ready_info() if ready_info is not None else {}
    if not isinstance(info, dict):
        raise TypeError(f"ready_info() returned {type(info).__name__}; it must return a JSON-serialisable dict")
    json.dumps(info)  # fails here, in the rank, with the offending value named, rather than in the launcher
    return info


class Deadline:
    """One deadline for a whole launch step (None: wait forever)."""

    def __init__(self, timeout_s: Optional[float]) -> None:
        self.timeout_s = timeout_s
        self._at = None if timeout_s is None else time.monotonic() + timeout_s

    def remaining(self) -> Optional[float]:
        return None if self._at is None else max(0.0, self._at - time.monotonic())

    def expired(self) -> bool:
        return self._at is not None and time.monotonic() >= self._at

    def text(self) -> str:
        return "ever" if self.timeout_s is None else f"{self.timeout_s:.0f} s"


def wait_for_all(
    items: Sequence[T],
    *,
    reached: Callable[[T], bool],
    wait_some: Callable[[list[T], Optional[float]], None],
    deadline: Deadline,
    late: Callable[[list[T]], BaseException],
    stop_all: Callable[[], None],
) -> None:
    """Wait until every item has ``reached`` its goal, all under one ``deadline``: both launchers' one wait loop.

    ``wait_some(pending, timeout)`` blocks until something may have changed for
    a pending item (or the timeout) and takes the step it can, raising at the
    first failure. On that failure, or at the deadline (``late(pending)`` is
    raised), ``stop_all`` stops every rank before the error goes up.
    """
    try:
        while True:
            pending = [item for item in items if not reached(item)]
            if not pending:
                return
            if deadline.expired():
                raise late(pending)
            wait_some(pending, deadline.remaining())
    except BaseException:
        stop_all()
        raise


# --------------------------------------------------------------------------- reading the binding back


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


def thread_mismatches(placement: ProcessPlacement, *, tasks_dir: str = "/proc/self/task") -> list[str]:
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


def read_back(placement: ProcessPlacement, *, premises: Iterable[str] = ()) -> dict[str, Any]:
    """Read this process's binding back and list every way it differs from ``placement``.

    ``premises`` are differences the launcher found in what the placement was
    resolved for (another node, another accelerator); they lead the list.
    """
    from sglang.srt.placement.observe import compare_binding, observe_self

    observed = observe_self()
    mismatches = [*premises, *compare_binding(placement, observed), *thread_mismatches(placement)]
    return {
        "pid": os.getpid(),
        "observed": observed.to_dict(),
        "threads": len(os.listdir("/proc/self/task")),
        "mismatches": mismatches,
    }


def report_mismatches(placement: ProcessPlacement, report: dict[str, Any], *, who: str,
                      warn: Callable[[str], None]) -> None:
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
