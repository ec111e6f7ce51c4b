"""A pass-through wrapper around ``multiprocessing.util.spawnv_passfds`` that starts a spawned child under an argv prefix.

CPython's spawn start method runs ``spawnv_passfds(spawn.get_executable(), cmd, fds)``;
the executable is process-global, so numactl's options cannot ride in it, and
swapping it (upstream's approach, with a script written to /tmp) races between
threads and breaks on a ``noexec`` /tmp. The wrapper is installed once; a
thread that is starting a placed child arms it with that child's argv prefix
(a thread-local value, cleared in ``finally``), and the wrapper prepends it
only to a spawn command line (``spawn_main``), never to the resource tracker
or anything else. No file is written, no shell runs, and launches in other
threads are not affected.
"""

from __future__ import annotations

import contextlib
import multiprocessing.util
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

from sglang.srt.placement.types import PlacementError

_SPAWN_MARKER = "spawn_main"



@dataclass
class SpawnPrefixUse:
    """One armed prefix and how many spawned children it has wrapped so far."""

    prefix: tuple[str, ...]
    applied: int = 0


class _Armed(threading.local):
    use: Optional[SpawnPrefixUse] = None


_armed = _Armed()
_install_lock = threading.Lock()
_original_spawnv_passfds: Optional[Callable[..., int]] = None


def _is_spawn_command(args: Sequence[Any]) -> bool:
    return any(_SPAWN_MARKER in str(arg) for arg in args)


def _placed_spawnv_passfds(path: Any, args: Sequence[Any], passfds: Sequence[int]) -> int:
    original = _original_spawnv_passfds
    if original is None:  # pragma: no cover - the hook is only reachable once installed
        raise RuntimeError("the multiprocessing spawn hook was called before it was installed")
    use = _armed.use
    if use is None or not _is_spawn_command(args):
        return original(path, args, passfds)
    # CPython hands the executable over as bytes (os.fsencode); keep to that type.
    pid = original(os.fsencode(use.prefix[0]), [*use.prefix, *args], passfds)
    use.applied += 1
    return pid


def install_spawn_hook() -> None:
    """Put the pass-through wrapper in front of ``multiprocessing.util.spawnv_passfds`` (idempotent)."""
    global _original_spawnv_passfds
    with _install_lock:
        current = getattr(multiprocessing.util, "spawnv_passfds", None)
        if current is None:
            raise PlacementError(
                "this Python's multiprocessing has no util.spawnv_passfds, so spawned schedulers cannot be "
                "started under numactl; set SGLANG_NUMA_BIND_V2=0 to bind inside the child instead"
            )
        if current is _placed_spawnv_passfds:
            return
        _original_spawnv_passfds = current
        multiprocessing.util.spawnv_passfds = _placed_spawnv_passfds


def spawn_hook_installed() -> bool:
    return multiprocessing.util.spawnv_passfds is _placed_spawnv_passfds


@contextlib.contextmanager
def spawn_with_prefix(prefix: Sequence[str]) -> Iterator[SpawnPrefixUse]:
    """Start every ``spawn`` child this thread creates inside the block as ``prefix + [python, ...]``.

    Nests (the inner prefix wins) and restores the previous state on any exit.
    """
    prefix = tuple(str(part) for part in prefix)
    if not prefix:
        raise ValueError("spawn_with_prefix needs a non-empty argv prefix (the program to exec first)")
    install_spawn_hook()
    use = SpawnPrefixUse(prefix=prefix)
    saved = _armed.use
    _armed.use = use
    try:
        yield use
    finally:
        _armed.use = saved


def armed_prefix() -> Optional[tuple[str, ...]]:
    """The prefix this thread would apply to a spawned child right now (None when unarmed)."""
    use = _armed.use
    return None if use is None else use.prefix
