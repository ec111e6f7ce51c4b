"""``numa_utils.configure_subprocess``: an exec placement's child starts under numactl
through a thread-local layer on ``multiprocessing.util.spawnv_passfds`` (upstream swaps
in a spawn executable, a script in /tmp: threads race, and a noexec /tmp breaks it)."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.spawn
import multiprocessing.util
import os
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence, Union

from sglang.srt.placement import settings
from sglang.srt.placement.apply import enforce_failure_policy, handle_bind_failure
from sglang.srt.placement.numactl import find_numactl
from sglang.srt.placement.resolve import place_gpu_id
from sglang.srt.placement.settings import PlacementPolicy
from sglang.srt.placement.types import Launcher, Strategy

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

_SPAWN_PROGRAM = re.compile(
    r"from multiprocessing\.spawn import spawn_main; "
    r"spawn_main\((?:\w+=(?:\d+|None)(?:, )?)*\)"
)
_FROZEN_ARGUMENT = re.compile(r"\w+=(?:\d+|None)")
_FORK_FLAG = "--multiprocessing-fork"
_Arg = Union[str, bytes]  # multiprocessing passes either


@contextlib.contextmanager
def placed_spawn(server_args: "ServerArgs", gpu_id: int) -> Iterator[None]:
    if not settings.bind_v2():
        yield  # legacy V1: the child binds itself (configure_scheduler_process)
        return
    who, env = f"GPU {gpu_id}", settings.device_env()
    policy = PlacementPolicy.from_env(server_args, launcher=Launcher.MP)
    if policy.device == "cpu":
        who = f"CPU rank {gpu_id}"
    elif "CUDA_VISIBLE_DEVICES" in env and settings.one_visible_device_per_process():
        who += f" (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']})"
    placement = place_gpu_id(gpu_id, policy=policy, env=env)
    enforce_failure_policy(placement, who=who, log=logger)
    if placement.strategy != Strategy.EXEC:
        logger.debug(f"{who}: nothing to apply around the spawn: {placement.reasons}")
        yield
        return
    # An exec placement was probed with the numactl found here: it starts the child.
    prefix = [find_numactl() or "numactl", *placement.numactl_args]
    executable = os.fsdecode(multiprocessing.spawn.get_executable())
    logger.info(f"{who}: the scheduler starts under {' '.join(prefix)}")
    with spawn_with_prefix(prefix) as use:
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


def is_spawned_child(args: Sequence[_Arg]) -> bool:
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
    applied: int = 0


class _ThreadState(threading.local):
    use: Optional[SpawnPrefixUse] = None
    inside: bool = False  # a layer runs: one below it passes the call straight down


_state = _ThreadState()
_install_lock = threading.Lock()


def _layer(below: Callable[..., int]) -> Callable[..., int]:
    def placed_spawnv_passfds(
        path: _Arg, args: Sequence[_Arg], passfds: Sequence[int]
    ) -> int:
        use = _state.use
        if _state.inside or use is None or not is_spawned_child(args):
            return below(path, args, passfds)
        _state.inside = True
        try:  # CPython hands the executable over as bytes
            pid = below(os.fsencode(use.prefix[0]), [*use.prefix, *args], passfds)
        finally:
            _state.inside = False
        use.applied += 1
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
def spawn_with_prefix(prefix: Sequence[str]) -> Iterator[SpawnPrefixUse]:
    """Each spawn child this thread starts in the block runs as ``prefix + argv`` (the
    inner block's wins). Other libraries may wrap ``spawnv_passfds`` and put back what
    they saved: a block adds a layer when a spawn would not reach one."""
    if not prefix:
        raise ValueError("spawn_with_prefix needs the program to exec first")
    with _install_lock:
        if not hook_reachable():
            multiprocessing.util.spawnv_passfds = _layer(
                multiprocessing.util.spawnv_passfds
            )
    use = SpawnPrefixUse(tuple(map(str, prefix)))
    saved, _state.use = _state.use, use
    try:
        yield use
    finally:
        _state.use = saved
