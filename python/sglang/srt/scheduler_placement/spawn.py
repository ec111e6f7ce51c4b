"""``numa_utils.configure_subprocess``: an exec placement's child starts under numactl
through a thread-local layer on ``multiprocessing.util.spawnv_passfds`` (upstream's
swapped spawn executable, a script in /tmp, races between threads and breaks on a
noexec /tmp)."""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing.spawn
import multiprocessing.util
import os
import queue
import re
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

from sglang.srt.placement import settings
from sglang.srt.placement.apply import enforce_failure_policy, handle_bind_failure
from sglang.srt.placement.numactl import run_numactl, true_program
from sglang.srt.placement.plan import HostFacts, place_gpu_id
from sglang.srt.placement.policy import PlacementPolicy, placement_view
from sglang.srt.placement.types import Strategy

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

EXEC_WAIT_S = 30.0  # for a child to leave numactl: a millisecond, far more under load
_SPAWN_PROGRAM = re.compile(
    r"from multiprocessing\.spawn import spawn_main; "
    r"spawn_main\((?:\w+=(?:\d+|None)(?:, )?)*\)"
)
_FROZEN_ARGUMENT = re.compile(r"\w+=(?:\d+|None)")
_FORK_FLAG = "--multiprocessing-fork"


@contextlib.contextmanager
def placed_spawn(server_args: "ServerArgs", gpu_id: int) -> Iterator[None]:
    if not settings.bind_v2():
        yield  # legacy V1: the child binds itself (configure_scheduler_process)
        return
    who = f"GPU {gpu_id}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if getattr(server_args, "device", None) == "cpu":
        who = f"CPU rank {gpu_id}"
    elif visible is not None and settings.one_visible_device_per_process():
        who += f" (CUDA_VISIBLE_DEVICES={visible})"
    view = placement_view(server_args)
    policy = PlacementPolicy.from_env(view, launcher="mp")
    facts = HostFacts.live()
    placement = place_gpu_id(view, gpu_id, policy=policy, facts=facts, env=os.environ)
    enforce_failure_policy(placement, who=who, log=logger)
    if placement.strategy != Strategy.EXEC:
        logger.debug(f"{who}: nothing to apply around the spawn: {placement.reasons}")
        yield
        return
    # An exec placement was probed with this numactl: the same binary starts the child.
    prefix = [facts.capabilities.numactl.numactl_path, *placement.numactl_args]
    executable = os.fsdecode(multiprocessing.spawn.get_executable())
    logger.info(f"{who}: the scheduler starts under {' '.join(prefix)}")
    watch = functools.partial(_exec_watch.submit, prefix=prefix, who=who)
    with spawn_with_prefix(prefix, after_spawn=watch) as use:
        yield
    problems = []
    after = os.fsdecode(multiprocessing.spawn.get_executable())
    if after != executable:
        problems.append(
            f"the multiprocessing spawn executable changed from {executable} to "
            f"{after} while the block ran (another library called "
            "multiprocessing.set_executable); children may run another interpreter"
        )
    if use.applied == 0:
        problems.append(
            "no process was started with the spawn start method inside the block, so "
            f"{' '.join(prefix)} was not applied (use multiprocessing.get_context"
            "('spawn'); a library that replaced multiprocessing.util.spawnv_passfds "
            "meanwhile, hiding sglang's layer, has the same effect)"
        )
    if problems:
        handle_bind_failure(f"{who}: " + "; ".join(problems), log=logger)


def is_spawned_child(args: Sequence[Any]) -> bool:
    """By structure, not substring (a forkserver's has its sys.path): a spawn child's
    command line, or a frozen executable's."""
    words = [os.fsdecode(a) if isinstance(a, bytes) else str(a) for a in args]
    if len(words) >= 4 and words[-1] == _FORK_FLAG and words[-3] == "-c":
        return _SPAWN_PROGRAM.fullmatch(words[-2]) is not None
    if len(words) >= 2 and words[1] == _FORK_FLAG:
        return all(_FROZEN_ARGUMENT.fullmatch(w) for w in words[2:])
    return False


@dataclass
class SpawnPrefixUse:
    prefix: tuple[str, ...]
    after_spawn: Optional[Callable[[int], None]] = None  # before anyone can reap
    applied: int = 0


class _ThreadState(threading.local):
    use: Optional[SpawnPrefixUse] = None
    inside: bool = False  # a layer runs: one below it passes the call straight down


_state = _ThreadState()
_install_lock = threading.Lock()


def _layer(below: Callable[..., int]) -> Callable[..., int]:
    def placed_spawnv_passfds(path: Any, args: Sequence[Any], passfds: Any) -> int:
        use = _state.use
        if _state.inside or use is None or not is_spawned_child(args):
            return below(path, args, passfds)
        _state.inside = True
        try:  # CPython hands the executable over as bytes
            pid = below(os.fsencode(use.prefix[0]), [*use.prefix, *args], passfds)
        finally:
            _state.inside = False
        use.applied += 1
        if use.after_spawn is not None:
            use.after_spawn(pid)
        return pid

    placed_spawnv_passfds.__wrapped__ = below  # type: ignore[attr-defined]
    placed_spawnv_passfds._sglang_spawn_layer = True  # type: ignore[attr-defined]
    return placed_spawnv_passfds


def hook_reachable() -> bool:
    current = multiprocessing.util.spawnv_passfds
    for _ in range(32):
        if current is None or getattr(current, "_sglang_spawn_layer", False):
            return current is not None
        current = getattr(current, "__wrapped__", None)
    return False


@contextlib.contextmanager
def spawn_with_prefix(
    prefix: Sequence[str], *, after_spawn: Optional[Callable[[int], None]] = None
) -> Iterator[SpawnPrefixUse]:
    """Each spawn child this thread starts in the block runs as ``prefix + argv``
    (the inner block's wins). Other libraries may wrap ``spawnv_passfds`` and put back
    what they saved: a block adds a layer when a spawn would not reach one."""
    if not prefix:
        raise ValueError("spawn_with_prefix needs the program to exec first")
    with _install_lock:
        if not hook_reachable():
            multiprocessing.util.spawnv_passfds = _layer(
                multiprocessing.util.spawnv_passfds
            )
    use = SpawnPrefixUse(tuple(map(str, prefix)), after_spawn)
    saved, _state.use = _state.use, use
    try:
        yield use
    finally:
        _state.use = saved


def armed_prefix() -> Optional[tuple[str, ...]]:
    return None if _state.use is None else _state.use.prefix


class _ExecWatch:
    """One daemon thread per process watches each placed child leave numactl: a thread
    per spawn would make every ``start()`` wait until it runs."""

    def __init__(self) -> None:
        self.forget()
        os.register_at_fork(after_in_child=self.forget)

    def forget(self) -> None:  # a forked child has none of its parent's threads
        self._lock = threading.Lock()
        self._queue: Optional[queue.SimpleQueue] = None

    def submit(self, pid: int, *, prefix: list[str], who: str) -> None:
        with self._lock:
            if self._queue is None:
                self._queue = queue.SimpleQueue()
                threading.Thread(
                    target=self._run,
                    args=(self._queue,),
                    name="sglang-numactl-watch",
                    daemon=True,
                ).start()
            self._queue.put((pid, prefix, who, time.monotonic() + EXEC_WAIT_S))

    @staticmethod
    def _run(children: queue.SimpleQueue) -> None:
        pending: list[tuple[int, list[str], str, float]] = []
        pause = 0.0005
        while True:
            try:
                pending.append(children.get(timeout=pause if pending else None))
                pause = 0.0005
            except queue.Empty:
                pause = min(pause * 2, 0.05)
            pending = [child for child in pending if not _watch_over(*child)]


_exec_watch = _ExecWatch()


def _watch_over(pid: int, prefix: list[str], who: str, deadline: float) -> bool:
    """Whether ``pid`` left numactl, died as numactl (reported here, not reaped: its
    launcher reports the death, this says why) or ran past the deadline."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [os.fsdecode(part) for part in f.read().split(b"\0") if part]
    except OSError:
        argv = []
    if argv:  # [numactl, ...], or [interpreter, numactl, ...] for a script
        return prefix[0] not in argv[:2] or time.monotonic() >= deadline
    # An exiting process (or a zombie) has no command line: it ended as numactl.
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True  # already reaped: its owner reports the exit
    if info is None:
        return time.monotonic() >= deadline
    # numactl's complaint went to the child's stderr, among every other process's;
    # asking numactl again, with the same options, ties it to the rank.
    result = run_numactl([*prefix, true_program()])
    why = result.message if not result.ok else "see the numactl message above"
    logger.error(
        f"{who}: numactl refused to start the scheduler process (pid {pid}, exit "
        f"status {info.si_status}) under {' '.join(prefix)}: {why}"
    )
    return True
