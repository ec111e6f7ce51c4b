"""The multiprocessing launcher: one spawned scheduler process per local rank, each under its placement.

An ``exec`` placement reaches the child through ``spawn_hook``: the spawn
command line is started under numactl, and the child keeps its pid.

A child that numactl refuses to start dies before Python runs; its sentinel
tells the parent at once, and the same numactl argv is run again with ``true``
to capture numactl's own message for the error.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from sglang.srt.placement.types import PlacementError, ProcessPlacement, RankIdentity, Strategy
from sglang.srt.scheduler_launch.child import run_scheduler_process
from sglang.srt.scheduler_launch.common import (
    DEFAULT_TIMEOUT_S,
    RankLaunchError,
    RankResult,
    decide_start,
    exec_command,
    numactl_complaint,
)
from sglang.srt.scheduler_launch.spawn_hook import spawn_with_prefix

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0


# --------------------------------------------------------------------------- launching ranks


def _start_plan(rank: RankIdentity, placement: ProcessPlacement) -> tuple[ProcessPlacement, Optional[list[str]]]:
    """The placement the child starts with and the numactl prefix in front of it (None unless exec).

    A refusal is caught here, before the spawn, rather than as a dead child:
    CPython writes the pickled child state into a pipe whose read end it keeps
    open until the write is done, so a large payload would block ``start()``
    once numactl has exited.
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


@dataclass
class LaunchedRank:
    """A started scheduler process and what the parent needs to follow it."""

    rank: RankIdentity
    placement: Optional[ProcessPlacement]
    process: Any
    reader: Any
    prefix: Optional[list[str]]
    info: Optional[dict] = None
    finished: bool = False
    eof: bool = False

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
    """Spawn one scheduler rank under its placement; returns at once (readiness comes through its pipe)."""
    ctx = context or multiprocessing.get_context("spawn")
    prefix: Optional[list[str]] = None
    if placement is not None:
        placement, prefix = _start_plan(rank, placement)
    reader, writer = ctx.Pipe(duplex=False)
    process = ctx.Process(
        target=run_scheduler_process,
        kwargs=dict(
            server_args=server_args,
            placement_json=placement.to_json() if placement is not None else None,
            rank=rank,
            target=target,
            pipe_writer=writer,
        ),
        name=f"sglang-scheduler-{rank.label.replace(' ', '-')}",
    )
    try:
        if prefix is not None:
            with spawn_with_prefix(prefix) as use:
                process.start()
            if use.applied != 1:
                raise PlacementError(
                    f"{rank.label}: the spawn hook wrapped {use.applied} processes instead of 1; the multiprocessing "
                    f"start method must be spawn for exec placements (numactl {' '.join(prefix[1:])})"
                )
        else:
            process.start()
    except BaseException:
        reader.close()
        writer.close()
        if process.pid is not None:
            _stop(process)
        raise
    # The parent's copy of the write end must go, or a dead child's pipe never reads as EOF.
    writer.close()
    how = f"under {' '.join(prefix)}" if prefix else f"strategy {placement.strategy if placement else 'none'}"
    logger.info(f"{rank.label}: scheduler process {process.pid} started {how}")
    return LaunchedRank(rank=rank, placement=placement, process=process, reader=reader, prefix=prefix)


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


def _wait_all(launched: Sequence[LaunchedRank], *, pending_of: Callable[[LaunchedRank], bool], expect: str,
              timeout_s: Optional[float], late: str) -> None:
    """Poll every rank until none is ``pending_of``; on the first failure or the deadline, stop all and raise."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        pending = [r for r in launched if pending_of(r)]
        while pending:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                names = ", ".join(r.label for r in pending)
                raise RankLaunchError(f"{names}: {late} {timeout_s:.0f} s", label=pending[0].label)
            multiprocessing.connection.wait(_wait_handles(pending), timeout=remaining)
            for r in pending:
                _poll_rank(r, expect=expect)
            pending = [r for r in launched if pending_of(r)]
    except BaseException:
        shutdown_ranks(launched)
        raise


def wait_ready(launched: Sequence[LaunchedRank], *, timeout_s: Optional[float] = DEFAULT_TIMEOUT_S) -> list[RankResult]:
    """Wait until every rank reports readiness; on the first failure or the deadline, stop all and raise."""
    _wait_all(launched, pending_of=lambda r: r.info is None, expect="ready", timeout_s=timeout_s,
              late="no readiness report within")
    return [RankResult(placement=r.placement, rank=r.rank, info=r.info or {}) for r in launched]


def wait_finished(launched: Sequence[LaunchedRank], *, timeout_s: Optional[float] = DEFAULT_TIMEOUT_S) -> None:
    """Wait until every rank's event loop returns and its process exits; on failure stop all and raise."""
    _wait_all(launched, pending_of=lambda r: not r.finished, expect="done", timeout_s=timeout_s,
              late="event loop still running after")
    try:
        for r in launched:
            r.process.join(SHUTDOWN_GRACE_S)
            if r.process.exitcode not in (0, None):
                raise RankLaunchError(f"{r.label}: exited with status {r.process.exitcode}", label=r.label)
    finally:
        shutdown_ranks(launched)


def _poll_rank(r: LaunchedRank, *, expect: str) -> None:
    """Take one step for ``r``: read a message if one is there, or notice that the process is gone."""
    if _read_one(r):
        return
    if r.process.is_alive():
        return
    # The child is gone; its last words may still be in the pipe.
    while _read_one(r):
        if (expect == "ready" and r.info is not None) or (expect == "done" and r.finished):
            return
    raise _death_error(r, stage="starting" if r.info is None else "running")


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


def _wait_handles(pending: Sequence[LaunchedRank]) -> list[Any]:
    return [r.reader for r in pending if not r.eof] + [r.process.sentinel for r in pending]


def _handle_message(r: LaunchedRank, message: Any) -> None:
    status = message.get("status") if isinstance(message, dict) else None
    if status == "ready":
        r.info = dict(message.get("info") or {})
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


def _death_error(r: LaunchedRank, *, stage: str) -> RankLaunchError:
    r.process.join(SHUTDOWN_GRACE_S)
    code = r.process.exitcode
    if r.prefix is not None and r.info is None:
        complaint = numactl_complaint(r.prefix)
        if complaint is not None:
            return _refusal_error(r.label, prefix=r.prefix, complaint=complaint, exit_status=code)
    return RankLaunchError(
        f"{r.label}: scheduler process {r.process.pid} died while {stage} with exit status {code} "
        f"before reporting (see its stderr above)",
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


def _stop(process: Any) -> None:
    if process.is_alive():
        process.terminate()
        process.join(SHUTDOWN_GRACE_S)
    if process.is_alive():
        process.kill()
        process.join(SHUTDOWN_GRACE_S)
    else:
        process.join(0)


def shutdown_ranks(launched: Sequence[LaunchedRank]) -> None:
    """Stop every rank that is still running and release the parent's pipe ends."""
    for r in launched:
        try:
            _stop(r.process)
        finally:
            try:
                r.reader.close()
            except OSError:
                pass
            with contextlib.suppress(ValueError, AttributeError):
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
    results = wait_ready(launched, timeout_s=timeout_s)
    wait_finished(launched, timeout_s=timeout_s)
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
