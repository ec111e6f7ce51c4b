"""The placement of one scheduler spawn: what
``numa_utils.configure_subprocess(server_args, gpu_id)`` does.

sglang's engine and data-parallel controller spawn every scheduler rank as
``with configure_subprocess(server_args, gpu_id): proc.start()``. At the
block's entry the rank of that ``gpu_id`` is placed (``placement.plan``)
under the ``CUDA_VISIBLE_DEVICES`` in force, and the failure policy acts
there, before anything is started: a rank that would be less bound than
intended gets one WARNING naming it and the reason, or, under
``SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1``, an error and no child. An ``exec``
placement arms the spawn hook so that the child starts under numactl; a
daemon thread then watches the child leave numactl, and reports numactl's
reason, tied to the rank, when numactl refused to start it.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.spawn
import os
import queue
import shutil
import threading
import time
from typing import Any, Iterator, Optional

from sglang.srt.placement import settings
from sglang.srt.placement.apply import handle_bind_failure
from sglang.srt.placement.numactl import numactl_prefix, run_numactl
from sglang.srt.placement.plan import HostFacts, place_gpu_id
from sglang.srt.placement.policy import PlacementPolicy, placement_view
from sglang.srt.placement.resolve import describe
from sglang.srt.placement.types import PlacementError, ProcessPlacement, Strategy
from sglang.srt.scheduler_placement.spawn_hook import hook_reachable, spawn_with_prefix

logger = logging.getLogger(__name__)

EXEC_WAIT_S = 30.0
"""How long the watch waits for a child to leave numactl (about a millisecond; far
more under load)."""

CRASH_SETTING = "SGLANG_CRASH_ON_NUMA_BIND_FAILURE"


def spawn_label(server_args: Any, gpu_id: int) -> str:
    """How logs name the spawn of ``gpu_id``: the GPU, and the visible devices when
    sglang narrowed them."""
    if getattr(server_args, "device", None) == "cpu":
        return f"CPU rank {gpu_id}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and settings.one_visible_device_per_process():
        return f"GPU {gpu_id} (CUDA_VISIBLE_DEVICES={visible})"
    return f"GPU {gpu_id}"


def spawn_placement(server_args: Any, gpu_id: int) -> ProcessPlacement:
    """Where the scheduler spawned for ``gpu_id`` runs, from this host's facts and this
    process's environment."""
    view = placement_view(server_args)
    policy = PlacementPolicy.from_env(view, launcher="mp")
    return place_gpu_id(
        view, gpu_id, policy=policy, facts=HostFacts.live(), env=os.environ
    )


def enforce_failure_policy(placement: ProcessPlacement, *, who: str) -> None:
    """One WARNING for a rank less bound than intended, or an error under
    SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1."""
    if not placement.warning:
        return
    reasons = "; ".join(placement.reasons)
    if placement.bound:
        handle_bind_failure(
            f"{who}: bound less tightly than planned: {reasons}", log=logger
        )
    else:
        handle_bind_failure(
            f"{who}: {reasons}; skipping NUMA binding for {who}.", log=logger
        )


@contextlib.contextmanager
def placed_spawn(server_args: Any, gpu_id: int) -> Iterator[None]:
    """The body of ``configure_subprocess``: children spawned in the block start under
    ``gpu_id``'s placement."""
    if not settings.bind_v2():
        yield  # legacy V1: the child binds itself (configure_scheduler_process)
        return
    who = spawn_label(server_args, gpu_id)
    placement = spawn_placement(server_args, gpu_id)
    enforce_failure_policy(placement, who=who)
    if placement.strategy != Strategy.EXEC:
        logger.debug(f"{who}: nothing to apply around the spawn: {describe(placement)}")
        yield
        return
    prefix = numactl_prefix(placement)
    executable_before = os.fsdecode(multiprocessing.spawn.get_executable())
    logger.info(f"{who}: the scheduler starts under {' '.join(prefix)}")
    failed = False
    with spawn_with_prefix(
        prefix, after_spawn=lambda pid: _exec_watch.submit(pid, prefix=prefix, who=who)
    ) as use:
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            if not failed:
                _check_block(
                    use.applied,
                    prefix=prefix,
                    who=who,
                    executable_before=executable_before,
                )


def _check_block(
    applied: int, *, prefix: list[str], who: str, executable_before: str
) -> None:
    problems = []
    executable_after = os.fsdecode(multiprocessing.spawn.get_executable())
    if executable_after != executable_before:
        problems.append(
            "the multiprocessing spawn executable changed from "
            f"{executable_before} to {executable_after} while the block ran (another "
            "library called multiprocessing.set_executable); children may run another "
            "interpreter"
        )
    if applied == 0:
        if not hook_reachable():
            problems.append(
                "multiprocessing.util.spawnv_passfds was replaced while the block ran, "
                "and the replacement does not lead to sglang's spawn hook: the child "
                f"was not started under {' '.join(prefix)}"
            )
        else:
            problems.append(
                "no process was started with the spawn start method inside the block, "
                f"so {' '.join(prefix)} was not applied (use "
                "multiprocessing.get_context('spawn'))"
            )
    if problems:
        message = f"{who}: " + "; ".join(problems)
        if settings.bind_failure_is_fatal():
            raise PlacementError(f"{message} ({CRASH_SETTING}=1)")
        logger.warning(message)


_Child = tuple[int, list[str], str]
"""(pid, numactl prefix, how logs name the rank)."""


class _ExecWatch:
    """One daemon thread per process that watches each placed child leave numactl.

    A thread of its own per spawn would make every ``start()`` wait until the
    new thread runs, which on a busy host costs more than the exec itself.
    """

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        """No thread yet: the state of a new process, and of a forked child, which has
        none of its parent's threads."""
        self._lock = threading.Lock()
        self._children: "Optional[queue.SimpleQueue[_Child]]" = None

    def submit(self, pid: int, *, prefix: list[str], who: str) -> None:
        with self._lock:
            if self._children is None:
                self._children = queue.SimpleQueue()
                threading.Thread(
                    target=self._run,
                    args=(self._children,),
                    name="sglang-numactl-watch",
                    daemon=True,
                ).start()
            self._children.put((pid, prefix, who))

    @staticmethod
    def _run(children: "queue.SimpleQueue[_Child]") -> None:
        pending: dict[int, tuple[list[str], str, float]] = {}
        pause = _FIRST_PAUSE_S
        while True:
            try:
                pid, prefix, who = children.get(timeout=pause if pending else None)
                pending[pid] = (prefix, who, time.monotonic() + EXEC_WAIT_S)
                pause = _FIRST_PAUSE_S
            except queue.Empty:
                pause = min(pause * 2, 0.05)
            for pid, (prefix, who, deadline) in list(pending.items()):
                done, status = _past_numactl(pid, numactl=prefix[0], deadline=deadline)
                if done:
                    del pending[pid]
                if status is not None:
                    _report_exec_failure(pid, status, prefix=prefix, who=who)


_FIRST_PAUSE_S = 0.0005
_exec_watch = _ExecWatch()
os.register_at_fork(after_in_child=_exec_watch.forget)


def _report_exec_failure(pid: int, status: int, *, prefix: list[str], who: str) -> None:
    """Say why numactl refused to start the child ``pid``, naming the rank.

    numactl's own complaint went to the child's stderr, mixed with every other
    process's; asking numactl again, with the same options, ties it to the rank.
    """
    result = (
        run_numactl([*prefix, shutil.which("true") or "/bin/true"])
        if os.path.exists(prefix[0])
        else None
    )
    why = (
        result.message
        if result is not None and not result.ok
        else "see the numactl message above"
    )
    # The child is gone already: the launcher's own wait reports its death; this says
    # why.
    logger.error(
        f"{who}: numactl refused to start the scheduler process (pid {pid}, exit "
        f"status {status}) under {' '.join(prefix)}: {why}"
    )


def _past_numactl(
    pid: int, *, numactl: str, deadline: float
) -> tuple[bool, Optional[int]]:
    """(whether the watch of ``pid`` is over, its exit status if it died while still
    numactl).

    It is over once ``pid`` runs another program, or when the deadline passed.
    The child is not reaped: multiprocessing waits for it as usual.
    """
    argv = _cmdline(pid)
    if not argv:
        # An exiting process (or a zombie) has no command line: it ended as numactl.
        status = _exit_status(pid)
        return status is not None or time.monotonic() >= deadline, status
    if numactl not in argv[:2]:  # [numactl, ...], or [interpreter, numactl, ...]
        return True, None
    if time.monotonic() >= deadline:
        logger.debug(f"pid {pid} still runs {numactl} after {EXEC_WAIT_S} s")
        return True, None
    return False, None


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [os.fsdecode(part) for part in f.read().split(b"\0") if part]
    except OSError:
        return []


def _exit_status(pid: int) -> Optional[int]:
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None  # not our child, or already reaped: its owner reports its exit code
    return None if info is None else info.si_status
