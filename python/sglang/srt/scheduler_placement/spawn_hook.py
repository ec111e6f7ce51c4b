"""A pass-through wrapper of ``multiprocessing.util.spawnv_passfds`` that starts a spawned child under an argv prefix.

CPython's spawn start method runs ``spawnv_passfds(spawn.get_executable(), cmd, fds)``;
the executable is process-global, so numactl's options cannot ride in it, and
swapping it (upstream's approach, with a script written to /tmp) races between
threads and breaks on a ``noexec`` /tmp. A thread that is starting a placed
child arms the wrapper with that child's argv prefix (a thread-local value,
cleared in ``finally``), and the wrapper prepends it only to a command line
that has the structure of a spawned child's (``-c`` running
``multiprocessing.spawn.spawn_main``, then ``--multiprocessing-fork``), never to
a forkserver, the resource tracker or anything else. No file is written, no
shell runs, and launches in other threads are not affected.

Other libraries may wrap ``spawnv_passfds`` too, before or after us, and may
later put back whatever they saved. So every block that arms the wrapper first
makes sure it is in the chain that a spawn goes through (``__wrapped__``
links, as ``functools.wraps`` leaves them), and puts a new layer in front when
it is not. A layer that is re-entered while an outer one runs (a library's
wrapper that calls whatever is current) passes the call straight down, so each
spawn gets the prefix once and no chain of wrappers loops.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.util
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

from sglang.srt.placement.types import PlacementError

logger = logging.getLogger(__name__)

SpawnFunction = Callable[[Any, Sequence[Any], Sequence[int]], int]

_SPAWN_PROGRAM = re.compile(
    r"from multiprocessing\.spawn import spawn_main; spawn_main\((?:\w+=(?:\d+|None)(?:, )?)*\)"
)
_FROZEN_ARGUMENT = re.compile(r"\w+=(?:\d+|None)")
_FORK_FLAG = "--multiprocessing-fork"
_MAX_WRAPPED_DEPTH = 32


def is_spawned_child(args: Sequence[Any]) -> bool:
    """Whether ``args`` is the command line of a child of the ``spawn`` start method.

    ``[python, *interpreter flags, "-c", "from multiprocessing.spawn import
    spawn_main; spawn_main(k=v, ...)", "--multiprocessing-fork"]``, or a frozen
    executable's ``[exe, "--multiprocessing-fork", "k=v", ...]``. Matching the
    structure (not a substring anywhere) keeps a forkserver, whose command line
    carries ``sys.path``, from ever being taken for a rank.
    """
    words = [os.fsdecode(a) if isinstance(a, bytes) else str(a) for a in args]
    if len(words) >= 4 and words[-1] == _FORK_FLAG and words[-3] == "-c":
        return _SPAWN_PROGRAM.fullmatch(words[-2]) is not None
    if len(words) >= 2 and words[1] == _FORK_FLAG:
        return all(_FROZEN_ARGUMENT.fullmatch(w) for w in words[2:])
    return False


@dataclass
class SpawnPrefixUse:
    """One armed prefix, the children it has started so far, and what ``after_spawn`` said of each."""

    prefix: tuple[str, ...]
    after_spawn: Optional[Callable[[int], Any]] = None
    """Called with each child's pid as soon as it is started, before the caller can reap it."""
    pids: list[int] = field(default_factory=list)
    outcomes: list[Any] = field(default_factory=list)

    @property
    def applied(self) -> int:
        return len(self.pids)


class _ThreadState(threading.local):
    use: Optional[SpawnPrefixUse] = None
    inside: bool = False
    """True while this thread runs a layer: an inner layer then passes the call down."""


_state = _ThreadState()
_install_lock = threading.Lock()
_installs = 0


def _layer(below: SpawnFunction) -> SpawnFunction:
    def placed_spawnv_passfds(
        path: Any, args: Sequence[Any], passfds: Sequence[int]
    ) -> int:
        use = _state.use
        if _state.inside or use is None or not is_spawned_child(args):
            return below(path, args, passfds)
        _state.inside = True
        try:
            # CPython hands the executable over as bytes (os.fsencode); keep to that type.
            pid = below(os.fsencode(use.prefix[0]), [*use.prefix, *args], passfds)
        finally:
            _state.inside = False
        use.pids.append(pid)
        if use.after_spawn is not None:
            use.outcomes.append(use.after_spawn(pid))
        return pid

    placed_spawnv_passfds.__wrapped__ = below  # type: ignore[attr-defined]
    placed_spawnv_passfds._sglang_spawn_layer = True  # type: ignore[attr-defined]
    return placed_spawnv_passfds


def hook_reachable() -> bool:
    """True when a spawn goes through one of our layers: it is ``spawnv_passfds``, or a wrapper
    in front says (``__wrapped__``) that it leads to one."""
    current: Any = getattr(multiprocessing.util, "spawnv_passfds", None)
    for _ in range(_MAX_WRAPPED_DEPTH):
        if current is None:
            return False
        if getattr(current, "_sglang_spawn_layer", False):
            return True
        current = getattr(current, "__wrapped__", None)
    return False


def ensure_hook() -> bool:
    """Put a layer in front of ``spawnv_passfds`` unless a spawn already reaches one.

    Returns True when a layer had been put there before and was no longer reached.
    """
    global _installs
    with _install_lock:
        if hook_reachable():
            return False
        current = getattr(multiprocessing.util, "spawnv_passfds", None)
        if current is None:
            raise PlacementError(
                "this Python's multiprocessing has no util.spawnv_passfds, so spawned schedulers cannot be "
                "started under numactl; set SGLANG_NUMA_BIND_V2=0 to bind inside the child instead"
            )
        multiprocessing.util.spawnv_passfds = _layer(current)
        _installs += 1
        return _installs > 1


@contextlib.contextmanager
def spawn_with_prefix(
    prefix: Sequence[str], *, after_spawn: Optional[Callable[[int], Any]] = None
) -> Iterator[SpawnPrefixUse]:
    """Start every ``spawn`` child this thread creates inside the block as ``prefix + [python, ...]``.

    Nests (the inner prefix wins) and restores the previous state on any exit.
    ``after_spawn(pid)`` runs right after each such child is started; its results
    are in ``SpawnPrefixUse.outcomes``.
    """
    prefix = tuple(str(part) for part in prefix)
    if not prefix:
        raise ValueError(
            "spawn_with_prefix needs a non-empty argv prefix (the program to exec first)"
        )
    if ensure_hook():
        logger.info(
            "multiprocessing.util.spawnv_passfds no longer led to sglang's spawn hook (another library "
            "replaced it since the last launch); the hook was put in front of it again"
        )
    use = SpawnPrefixUse(prefix=prefix, after_spawn=after_spawn)
    saved = _state.use
    _state.use = use
    try:
        yield use
    finally:
        _state.use = saved


def armed_prefix() -> Optional[tuple[str, ...]]:
    """The prefix this thread would apply to a spawned child right now (None when unarmed)."""
    use = _state.use
    return None if use is None else use.prefix
