"""The multiprocessing launcher: one spawned scheduler process per local rank, each under its placement.

An ``exec`` placement reaches the child through ``spawn_hook``: the spawn
command line is started under numactl, and the child keeps its pid.

A launch always ends within its deadline. ``Process.start()`` only hands the
child its label and three pipe ends, a payload far below a pipe's capacity, so
CPython's blocking write of it can never wait on a child that died or stalls
before reading. The rank's real arguments (server args, target, placement)
follow through its *lifeline*, written without blocking from the same wait loop
that reads readiness and watches each child's sentinel. The parent keeps the
lifeline's write end open for the life of the rank: the rank exits when it reads
end of file, that is when the launcher process is gone, whichever of its threads
started it (see ``child``).

A child that numactl refuses to start dies before Python runs; its sentinel
tells the parent at once, and the same numactl argv is run again with ``true``
to capture numactl's own message for the error.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import select
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from sglang.srt.placement.types import PlacementError, ProcessPlacement, RankIdentity, Strategy
from sglang.srt.scheduler_rank.child import frame_arguments, run_spawned_rank
from sglang.srt.scheduler_rank.common import (
    DEFAULT_TIMEOUT_S,
    Deadline,
    RankLaunchError,
    RankResult,
    decide_start,
    exec_command,
    numactl_complaint,
    wait_for_all,
)
from sglang.srt.scheduler_launch.spawn_hook import spawn_with_prefix

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0

# --------------------------------------------------------------------------- launching ranks


def _start_plan(rank: RankIdentity, placement: ProcessPlacement) -> tuple[ProcessPlacement, Optional[list[str]]]:
    """The placement the child starts with and the numactl prefix in front of it (None unless exec).

    A refusal that numactl's (cached) dry run already knows is raised here,
    before anything is spawned; one that only the real start meets ends the
    child, and the wait loop reports it from the child's sentinel.
    """
    if placement.strategy != Strategy.EXEC:
        return placement, None
    command = exec_command(placement, python=sys.executable)
    if command.argv is None and not command.numactl_missing:
        from sglang.srt.placement.numactl import numactl_prefix

        raise _refusal_error(rank.label, prefix=numactl_prefix(placement), complaint=command.refusal or "",
                             exit_status=None)
    started = decide_start(placement, command, log=logger.warning)
    return started, (list(command.prefix) if started.strategy == Strategy.EXEC and command.prefix else None)


@dataclass(eq=False)
class LaunchedRank:
    """A started scheduler process and what the parent needs to follow it."""

    rank: RankIdentity
    placement: Optional[ProcessPlacement]
    process: Any
    reader: Any
    prefix: Optional[list[str]]
    lifeline: Optional[int] = None
    """The parent's (non-blocking) write end of the rank's lifeline; open while the rank may run."""
    unsent: memoryview = field(default_factory=lambda: memoryview(b""))
    """What is left to write of the rank's framed arguments."""
    info: Optional[dict] = None
    binding: dict = field(default_factory=dict)
    finished: bool = False
    exited: bool = False
    eof: bool = False
    closed: bool = False

    @property
    def label(self) -> str:
        return self.rank.label


def start_scheduler_process(
    server_args: Any,
    *,
    target: Callable[..., Any],
    rank: RankIdentity,
    placement: Optional[ProcessPlacement],
    context: Any = None,
) -> LaunchedRank:
    """Spawn one scheduler rank under its placement; returns at once (readiness comes through its pipe).

    The rank's arguments are written to its lifeline as far as the pipe takes
    them now; ``wait_ready`` writes the rest.
    """
    ctx = context or multiprocessing.get_context("spawn")
    prefix: Optional[list[str]] = None
    if placement is not None:
        placement, prefix = _start_plan(rank, placement)
    arguments = frame_arguments(dict(
        server_args=server_args,
        placement_json=placement.to_json() if placement is not None else None,
        rank=rank,
        target=target,
    ))
    reader, writer = ctx.Pipe(duplex=False)
    child_end, lifeline = os.pipe()
    os.set_blocking(lifeline, False)
    child_lifeline = multiprocessing.connection.Connection(child_end, writable=False)
    process = ctx.Process(
        target=run_spawned_rank,
        kwargs=dict(
            label=rank.label,
            lifeline=child_lifeline,
            pipe_writer=writer,
            # A forkserver, not this process, is the parent of its children.
            parent_pid=os.getpid() if ctx.get_start_method() != "forkserver" else None,
            die_with_parent_thread=threading.current_thread() is threading.main_thread(),
        ),
        name=f"sglang-scheduler-{rank.label.replace(' ', '-')}",
    )
    launched = LaunchedRank(rank=rank, placement=placement, process=process, reader=reader, prefix=prefix,
                            lifeline=lifeline, unsent=memoryview(arguments))
    try:
        if prefix is not None:
            with spawn_with_prefix(prefix) as use:
                process.start()
            if use.applied != 1:
                raise PlacementError(
                    f"{rank.label}: the spawn hook wrapped {use.applied} processes instead of 1; the multiprocessing "
                    f"start method must be spawn for exec placements, and other code must not replace "
                    f"multiprocessing.util.spawnv_passfds without calling the function it replaced "
                    f"(numactl {' '.join(prefix[1:])})"
                )
        else:
            process.start()
    except BaseException:
        writer.close()
        child_lifeline.close()
        if process.pid is None:
            launched.process = None
        shutdown_ranks([launched])
        raise
    # The parent's copies of the child's ends must go, or a dead child's pipes never read as EOF (or EPIPE).
    writer.close()
    child_lifeline.close()
    _send_arguments(launched)
    how = f"under {' '.join(prefix)}" if prefix else f"strategy {placement.strategy if placement else 'none'}"
    logger.info(f"{rank.label}: scheduler process {process.pid} started {how}")
    return launched


def launch_scheduler_processes(
    server_args: Any,
    *,
    target: Callable[..., Any],
    placements: Optional[Sequence[ProcessPlacement]] = None,
    ranks: Optional[Sequence[RankIdentity]] = None,
    context: Any = None,
) -> list[LaunchedRank]:
    """Start every local rank; if any start fails, the ones already started are stopped before raising."""
    if placements is None:
        placements = _plan(server_args)
    if ranks is None:
        ranks = _ranks_for(server_args, placements)
    if len(ranks) != len(placements):
        raise ValueError(f"{len(ranks)} ranks but {len(placements)} placements: give one placement per rank")
    launched: list[LaunchedRank] = []
    try:
        for rank, placement in zip(ranks, placements):
            launched.append(
                start_scheduler_process(server_args, target=target, rank=rank, placement=placement, context=context)
            )
    except BaseException:
        shutdown_ranks(launched)
        raise
    return launched


# --------------------------------------------------------------------------- the wait loop


def _wait_all(launched: Sequence[LaunchedRank], *, expect: str, timeout_s: Optional[float], late: str) -> None:
    """Follow every rank until each has reached ``expect`` ("ready", or "done" and exited), all under one deadline.

    One loop for both: it writes what is left of each rank's arguments, reads
    its messages and reaps it when its sentinel fires. The first failure, or the
    deadline, stops every rank and raises :class:`RankLaunchError` naming the rank.
    """

    def step(pending: list[LaunchedRank], timeout: Optional[float]) -> None:
        _wait_for_any(pending, timeout_s=timeout)
        for r in pending:
            _step(r, expect=expect)

    def overdue(pending: list[LaunchedRank]) -> RankLaunchError:
        return RankLaunchError(
            f"{', '.join(r.label for r in pending)}: {late} {deadline.text()}{_stall_hint(pending)}",
            label=pending[0].label,
        )

    deadline = Deadline(timeout_s)
    wait_for_all(launched, reached=_REACHED[expect], wait_some=step, deadline=deadline, late=overdue,
                 stop_all=lambda: shutdown_ranks(launched))


_REACHED: dict[str, Callable[[LaunchedRank], bool]] = {
    "ready": lambda r: r.info is not None,
    "done": lambda r: r.exited,
}


def wait_ready(launched: Sequence[LaunchedRank], *, timeout_s: Optional[float] = DEFAULT_TIMEOUT_S) -> list[RankResult]:
    """Wait until every rank reports readiness; on the first failure or the deadline, stop all and raise.

    A rank's arguments that did not fit its lifeline at start are written here,
    under the same deadline.
    """
    _wait_all(launched, expect="ready", timeout_s=timeout_s, late="no readiness report within")
    return [RankResult(placement=r.placement, rank=r.rank, info=r.info or {}, binding=r.binding) for r in launched]


def wait_finished(launched: Sequence[LaunchedRank], *, timeout_s: Optional[float] = DEFAULT_TIMEOUT_S) -> None:
    """Wait until every rank's event loop returns and its process exits; then (or on failure) stop all."""
    try:
        _wait_all(launched, expect="done", timeout_s=timeout_s, late="event loop still running after")
    finally:
        shutdown_ranks(launched)


def _wait_for_any(pending: Sequence[LaunchedRank], *, timeout_s: Optional[float]) -> None:
    """Block until some rank can take more of its arguments, has a message, or has exited (or the timeout)."""
    poller = select.poll()
    for r in pending:
        if r.unsent and r.lifeline is not None:
            poller.register(r.lifeline, select.POLLOUT)
        if not r.eof:
            poller.register(r.reader.fileno(), select.POLLIN)
        poller.register(r.process.sentinel, select.POLLIN)
    poller.poll(None if timeout_s is None else max(1, int(timeout_s * 1000)))


def _step(r: LaunchedRank, *, expect: str) -> None:
    """Take every step ``r`` allows now without blocking: write, read its messages, notice that it exited."""
    _send_arguments(r)
    while _read_one(r):
        pass
    if r.exited or r.process.is_alive():
        return
    # The child is gone; its last words may still be in the pipe.
    while _read_one(r):
        pass
    if r.finished:
        if r.process.exitcode != 0:
            raise RankLaunchError(f"{r.label}: exited with status {r.process.exitcode} after its event loop returned",
                                  label=r.label)
        r.exited = True
        return
    if expect == "ready" and r.info is not None:
        return
    raise _death_error(r, stage="starting" if r.info is None else "running")


def _send_arguments(r: LaunchedRank) -> None:
    """Write as much of ``r``'s arguments as its lifeline takes now; never blocks."""
    while r.unsent and r.lifeline is not None:
        try:
            written = os.write(r.lifeline, r.unsent)
        except BlockingIOError:
            return
        except BrokenPipeError:
            # The child is gone (its sentinel tells the wait loop how it ended), or it closed its end.
            os.close(r.lifeline)
            r.lifeline = None
            return
        r.unsent = r.unsent[written:]


def _read_one(r: LaunchedRank) -> bool:
    """Handle one message from ``r`` if one is waiting; False when there is none (or the pipe is at EOF)."""
    if r.eof:
        return False
    try:
        if not r.reader.poll(0):
            return False
        message = r.reader.recv()
    except (EOFError, OSError):
        r.eof = True
        return False
    _handle_message(r, message)
    return True


def _handle_message(r: LaunchedRank, message: Any) -> None:
    status = message.get("status") if isinstance(message, dict) else None
    if status == "ready":
        r.info = dict(message.get("info") or {})
        r.binding = dict(message.get("binding") or {})
    elif status == "done":
        r.finished = True
    elif status == "error":
        stage = message.get("stage", "start")
        what = "failed to start" if stage == "start" else "failed while running"
        error = str(message.get("error", "unknown error"))
        tb = str(message.get("traceback", ""))
        raise RankLaunchError(
            f"{r.label}: scheduler {what}: {error}\n--- traceback from the rank ---\n{tb}",
            label=r.label, error=error, child_traceback=tb,
        )
    else:
        raise RankLaunchError(f"{r.label}: unexpected message from the scheduler process: {message!r}", label=r.label)


def _stall_hint(pending: Sequence[LaunchedRank]) -> str:
    stalled = [r for r in pending if r.unsent]
    if not stalled:
        return ""
    return (
        f" ({', '.join(f'{r.label} (pid {r.process.pid})' for r in stalled)} had not read its arguments: stuck "
        f"before Python ran the rank's entry, e.g. in the program in front of it or in the interpreter's start-up)"
    )


def _death_error(r: LaunchedRank, *, stage: str) -> RankLaunchError:
    r.process.join(0)
    code = r.process.exitcode
    if r.prefix is not None and r.info is None:
        complaint = numactl_complaint(r.prefix)
        if complaint is not None:
            return _refusal_error(r.label, prefix=r.prefix, complaint=complaint, exit_status=code)
    before = "it read its arguments" if r.unsent else "reporting"
    return RankLaunchError(
        f"{r.label}: scheduler process {r.process.pid} died while {stage} with exit status {code} "
        f"before {before} (see its stderr above)",
        label=r.label,
    )


def _refusal_error(label: str, *, prefix: Sequence[str], complaint: str, exit_status: Optional[int]) -> RankLaunchError:
    status = "" if exit_status is None else f" (exit status {exit_status})"
    return RankLaunchError(
        f"{label}: numactl refused to start the scheduler{status}: {complaint} "
        f"(command: {' '.join(prefix)} <python>); fix or remove the binding for this rank, "
        f"e.g. --numa-node, SGLANG_NUMA_AFFINITY_MODE, or SGLANG_NUMA_BIND_V2=0",
        label=label, error=complaint,
    )


# --------------------------------------------------------------------------- shutting down


def shutdown_ranks(launched: Sequence[LaunchedRank]) -> None:
    """Stop every rank that is still running and release the parent's ends of its pipes; safe to call again."""
    ranks = [r for r in launched if not r.closed]
    for r in ranks:
        r.closed = True
    try:
        _stop_all([r.process for r in ranks if r.process is not None])
    finally:
        for r in ranks:
            _release(r)


def _stop_all(processes: Sequence[Any]) -> None:
    """SIGTERM every live process, SIGKILL what is left after the grace period, and reap them all."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    grace = Deadline(SHUTDOWN_GRACE_S)
    for process in processes:
        process.join(grace.remaining())
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(SHUTDOWN_GRACE_S)


def _release(r: LaunchedRank) -> None:
    try:
        r.reader.close()
    except OSError:
        pass
    if r.lifeline is not None:
        # Closing it after the stop: a rank still alive somehow reads end of file and exits.
        os.close(r.lifeline)
        r.lifeline = None
    r.unsent = memoryview(b"")
    if r.process is not None and r.process.exitcode is not None:
        r.process.close()


def run_ranks_mp(
    server_args: Any,
    *,
    target: Callable[..., Any],
    placements: Optional[Sequence[ProcessPlacement]] = None,
    ranks: Optional[Sequence[RankIdentity]] = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    context: Any = None,
) -> list[RankResult]:
    """Start every local rank under its placement, wait for readiness, run the event loops out, shut down.

    Raises :class:`RankLaunchError` naming the failed rank (with its traceback,
    or numactl's message) and leaves no process behind.
    """
    launched = launch_scheduler_processes(
        server_args, target=target, placements=placements, ranks=ranks, context=context
    )
    results = wait_ready(launched, timeout_s=timeout_s)  # stops every rank if it raises
    wait_finished(launched, timeout_s=timeout_s)  # stops every rank in any case
    return results


def _plan(server_args: Any) -> Sequence[ProcessPlacement]:
    from sglang.srt.placement.resolve import plan_engine

    return plan_engine(server_args, launcher="mp")


def _ranks_for(server_args: Any, placements: Sequence[ProcessPlacement]) -> list[RankIdentity]:
    """Each placement's rank identity as the engine numbers it; by position when the engine has no such rank."""
    known: dict[tuple[int, int, int], RankIdentity] = {}
    try:
        from sglang.srt.placement.resolve import local_ranks
    except ImportError:
        local_ranks = None
    if local_ranks is not None:
        known = {(r.dp_rank, r.pp_rank, r.tp_rank): r for r in local_ranks(server_args)}
    ranks = []
    for index, p in enumerate(placements):
        rank = known.get((p.dp_rank, p.pp_rank, p.tp_rank))
        if rank is None:
            rank = RankIdentity(
                dp_rank=p.dp_rank, pp_rank=p.pp_rank, tp_rank=p.tp_rank, gpu_id=p.gpu_id, global_rank=index
            )
        ranks.append(rank)
    return ranks
