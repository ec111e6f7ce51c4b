"""The spawn hook: only a spawned child's command line gets the prefix, and no other library can lose it.

Children here are real spawn-context processes; the prefix is a real program
(``env``, which runs the rest of the argv), and each child reports its own
command line and environment, so the tests see what was really exec'd.
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.util
import os
import shutil
import sys
import threading

import pytest

from sglang.srt.scheduler_placement import spawn
from sglang.srt.scheduler_placement.spawn import is_spawned_child, spawn_with_prefix

ENV = shutil.which("env")
EXE = sys.executable


def report_argv(queue) -> None:
    with open("/proc/self/cmdline", "rb") as f:
        cmdline = [part.decode() for part in f.read().split(b"\0") if part]
    queue.put(
        {"marker": os.environ.get("SPAWN_HOOK_MARKER"), "argv0": cmdline[0]}
    )  # env has exec'd python


def marked_prefix(value: str) -> list[str]:
    """``env SPAWN_HOOK_MARKER=value`` in front of the interpreter: the child sees the marker."""
    return [ENV, f"SPAWN_HOOK_MARKER={value}"]


def spawn_one(prefix=None) -> dict:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=report_argv, args=(queue,))
    if prefix is None:
        proc.start()
    else:
        with spawn_with_prefix(prefix) as use:
            proc.start()
        assert use.applied == 1
    try:
        return queue.get(timeout=120)
    finally:
        proc.join(30)


@pytest.fixture
def saved_spawnv():
    """multiprocessing's own spawnv_passfds (below any layer of ours); the state is restored afterwards."""
    before = multiprocessing.util.spawnv_passfds
    own = before
    while getattr(own, "_sglang_spawn_layer", False):
        own = own.__wrapped__
    yield own
    multiprocessing.util.spawnv_passfds = before


def test_the_structure_of_a_spawned_childs_command_line_is_recognised():
    spawn_cmd = [
        EXE,
        "-B",
        "-c",
        "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, "
        "pipe_handle=7)",
        "--multiprocessing-fork",
    ]
    assert is_spawned_child(spawn_cmd)
    assert is_spawned_child(
        [b"/x/frozen", b"--multiprocessing-fork", b"tracker_fd=5", b"pipe_handle=7"]
    )
    # A forkserver's command line names spawn_main only through its sys_path argument.
    forkserver = [
        EXE,
        "-c",
        "from multiprocessing.forkserver import main; main(3, 5, ['m'], **{'sys_path': "
        "['/opt/spawn_main'], 'main_path': None})",
    ]
    tracker = [EXE, "-c", "from multiprocessing.resource_tracker import main;main(9)"]
    extra = [*spawn_cmd[:-1], "--multiprocessing-fork", "--and-more"]
    assert not any(map(is_spawned_child, (forkserver, tracker, extra)))


def test_a_spawned_child_starts_under_the_prefix_and_others_do_not():
    assert spawn_one(marked_prefix("placed"))["marker"] == "placed"
    assert spawn_one()["marker"] is None


def test_prefixes_nest_and_an_empty_one_is_refused():
    with spawn_with_prefix(marked_prefix("outer")):
        assert spawn_one(marked_prefix("inner"))["marker"] == "inner"
        assert (spawn._state.use and spawn._state.use.prefix) == tuple(
            marked_prefix("outer")
        )
    assert (spawn._state.use and spawn._state.use.prefix) is None
    with pytest.raises(ValueError):
        with spawn_with_prefix([]):
            pass


def test_a_library_that_wraps_and_later_restores_spawnv_passfds_loses_nothing(
    saved_spawnv,
):
    """It wraps before the first block and puts back what it saved afterwards: later blocks re-arm."""
    spawn_one(marked_prefix("first"))  # our layer is in place
    saved = multiprocessing.util.spawnv_passfds
    calls = []

    def library_wrapper(path, args, passfds):
        calls.append(args[0])
        return saved(path, args, passfds)

    multiprocessing.util.spawnv_passfds = (
        library_wrapper  # no __wrapped__: cannot be seen through
    )
    assert spawn_one(marked_prefix("wrapped"))["marker"] == "wrapped"
    multiprocessing.util.spawnv_passfds = (
        saved_spawnv  # the library puts back what it found first
    )
    assert not spawn.hook_reachable()
    assert spawn_one(marked_prefix("restored"))["marker"] == "restored"
    assert calls, "the library's wrapper saw the spawn"


def test_layers_on_both_sides_of_a_hiding_wrapper_apply_the_prefix_once(saved_spawnv):
    spawn_one(marked_prefix("first"))
    below = multiprocessing.util.spawnv_passfds
    seen = []

    def hiding(
        path, args, passfds
    ):  # wraps our layer without saying so (no __wrapped__)
        seen.append(list(args))
        return below(path, args, passfds)

    multiprocessing.util.spawnv_passfds = hiding
    # The next block cannot see through it and puts a new layer on top; the layer below passes the call on.
    out = spawn_one(marked_prefix("once"))
    assert out["marker"] == "once"
    (args,) = seen
    assert args[:2] == marked_prefix("once") and args.count(ENV) == 1, args


def test_wrappers_from_many_threads_each_spawn_keeps_its_prefix(saved_spawnv):
    original = multiprocessing.util.spawnv_passfds

    @functools.wraps(original)
    def other_library(path, args, passfds):
        return original(path, args, passfds)

    multiprocessing.util.spawnv_passfds = other_library
    results: dict[int, dict] = {}

    def launch(index: int) -> None:
        results[index] = spawn_one(marked_prefix(f"thread-{index}"))

    threads = [threading.Thread(target=launch, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {i: r["marker"] for i, r in results.items()} == {
        i: f"thread-{i}" for i in range(4)
    }


FORKSERVER_CHILD = r"""
import multiprocessing, os, sys
sys.path.insert(0, sys.argv[1])
from test_spawn_hook import ENV, report_argv
from sglang.srt.scheduler_placement.spawn import spawn_with_prefix

if __name__ == "__main__":
    sys.path.append("/opt/spawn_main")  # a sys.path entry that names spawn_main
    forkserver = multiprocessing.get_context("forkserver")
    with spawn_with_prefix([ENV, "SPAWN_HOOK_MARKER=placed"]) as use:
        queue = forkserver.Queue()
        child = forkserver.Process(target=report_argv, args=(queue,))
        child.start()  # starts the forkserver itself inside the block
    print(use.applied, queue.get(timeout=120)["marker"])
    child.join()
"""


def test_a_forkserver_started_inside_a_block_is_not_wrapped(tmp_path):
    import subprocess

    script = tmp_path / "forkserver_child.py"
    script.write_text(FORKSERVER_CHILD)
    done = subprocess.run(
        [EXE, str(script), os.path.dirname(os.path.abspath(__file__))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["0", "None"], done.stdout
