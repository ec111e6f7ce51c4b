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

The wrapper goes in once per process and chains to whatever it found there. Another
library may wrap ``spawnv_passfds`` after it (its wrapper then calls this one) or
before it (this one calls that); either way each spawn passes through every wrapper
once. Later launches never re-install it on top of such a wrapper, which would make
the wrapper this one's "original" and the two call each other forever.
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
    inside: bool = False
    """True while this thread runs the wrapper: a second entry means the chain below leads back to it."""


_armed = _Armed()
_install_lock = threading.Lock()
_original_spawnv_passfds: Optional[Callable[..., int]] = None
_MAX_WRAPPED_DEPTH = 32


def _is_spawn_command(args: Sequence[Any]) -> bool:
    return any(_SPAWN_MARKER in str(arg) for arg in args)


def _placed_spawnv_passfds(path: Any, args: Sequence[Any], passfds: Sequence[int]) -> int:
    original = _original_spawnv_passfds
    if original is None:  # pragma: no cover - the hook is only reachable once installed
        raise RuntimeError("the multiprocessing spawn hook was called before it was installed")
    if _armed.inside:
        raise PlacementError(
            "multiprocessing.util.spawnv_passfds leads back into sglang's spawn hook: a wrapper below it calls "
            "whatever spawnv_passfds is current instead of the function it wrapped; make that wrapper keep "
            "and call the function it replaced"
        )
    _armed.inside = True
    try:
        use = _armed.use
        if use is None or not _is_spawn_command(args):
            return original(path, args, passfds)
        # CPython hands the executable over as bytes (os.fsencode); keep to that type.
        pid = original(os.fsencode(use.prefix[0]), [*use.prefix, *args], passfds)
        use.applied += 1
        return pid
    finally:
        _armed.inside = False


def install_spawn_hook() -> None:
    """Put the pass-through wrapper in front of ``multiprocessing.util.spawnv_passfds``, once per process.

    Once installed it is left where it is, even when another library has wrapped it
    since: it is still in the chain, and wrapping that library's wrapper would loop.
    """
    global _original_spawnv_passfds
    with _install_lock:
        if _original_spawnv_passfds is not None:
            return
        current = getattr(multiprocessing.util, "spawnv_passfds", None)
        if current is None:
            raise PlacementError(
                "this Python's multiprocessing has no util.spawnv_passfds, so spawned schedulers cannot be "
                "started under numactl; set SGLANG_NUMA_BIND_V2=0 to bind inside the child instead"
            )
        _original_spawnv_passfds = current
        multiprocessing.util.spawnv_passfds = _placed_spawnv_passfds


def spawn_hook_installed() -> bool:
    """True when spawns reach the wrapper: it is ``spawnv_passfds``, or a wrapper in front of it says it wraps it.

    A wrapper that does not set ``__wrapped__`` (``functools.wraps`` does) cannot be
    seen through; the count in :class:`SpawnPrefixUse` tells for sure after a spawn.
    """
    current: Any = multiprocessing.util.spawnv_passfds
    for _ in range(_MAX_WRAPPED_DEPTH):
        if current is _placed_spawnv_passfds:
            return True
        current = getattr(current, "__wrapped__", None)
        if current is None:
            return False
    return False


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
