"""Launcher scenarios that need a process of their own: run as ``python mp_scenarios.py NAME [ARGS]``.

Each changes something process-wide (its CPU affinity, its cgroup, the spawn hook
chain) or is killed on purpose, so it runs in a fresh interpreter rather than in
the test runner. Each prints one JSON line on stdout as its last line; the
launch's own logs go to stderr.
"""

from __future__ import annotations

import functools
import json
import logging
import multiprocessing.util
import os
import sys
import threading
import time

from sglang.srt.placement.types import ProcessPlacement
from sglang.srt.scheduler_launch import mp
from sglang.srt.scheduler_rank.common import ExecCommand, RankLaunchError
from sglang.srt.placement.engine_args import EngineArgs

from mp_launch_targets import exec_placement, report_target, unbound_placement

LARGE_FIELD_BYTES = 200_000

# Argv prefixes standing in for numactl: each runs the program after it unchanged (so a dry
# run with `true` passes), except a spawned child's command line, which it ends or stalls.
_EXIT_ON_SPAWN = (
    "import os, sys\n"
    "if any('spawn_main' in a for a in sys.argv): os._exit(3)\n"
    "os.execv(sys.argv[1], sys.argv[1:])\n"
)
_STALL_ON_SPAWN = (
    "import os, sys, time\n"
    "if any('spawn_main' in a for a in sys.argv): time.sleep(60)\n"
    "os.execv(sys.argv[1], sys.argv[1:])\n"
)
PREFIX_PROGRAMS = {"exit": _EXIT_ON_SPAWN, "stall": _STALL_ON_SPAWN}


def _emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def _large_server_args() -> EngineArgs:
    server_args = EngineArgs()
    server_args.large_field = "x" * LARGE_FIELD_BYTES
    return server_args


def _timed_launch(placement: ProcessPlacement, *, timeout_s: float) -> None:
    started = time.monotonic()
    try:
        mp.run_ranks_mp(_large_server_args(), target=report_target, placements=[placement], timeout_s=timeout_s)
    except RankLaunchError as exc:
        _emit(ok=False, elapsed_s=time.monotonic() - started, label=exc.label, message=str(exc))
    else:
        _emit(ok=True, elapsed_s=time.monotonic() - started)


def narrowed_affinity() -> None:
    """The probe said yes; then this process's affinity narrows to CPU 0 and a rank is placed on CPU 1."""
    from sglang.srt.placement.numactl import default_prober

    placement = exec_placement(0, 1)
    assert default_prober().probe(placement.numactl_args).ok
    os.sched_setaffinity(0, {0})
    _timed_launch(placement, timeout_s=10)


def prefix_fault(kind: str, timeout_s: str) -> None:
    """Start the rank under a prefix that ends (``exit``) or stalls (``stall``) the child before Python runs."""
    prefix = (sys.executable, "-c", PREFIX_PROGRAMS[kind])
    mp.exec_command = lambda placement, *, python: ExecCommand(argv=(*prefix, python))
    _timed_launch(exec_placement(0, 1), timeout_s=float(timeout_s))


def killed_launcher(where: str) -> None:
    """Start a rank whose target is slow to import and never gets ready; print its pid, then wait on it."""
    from mp_slow_import_targets import hanging_target

    def launch() -> None:
        launched = mp.launch_scheduler_processes(EngineArgs(), target=hanging_target, placements=[unbound_placement(0)])
        _emit(pid=launched[0].process.pid, launcher_pid=os.getpid())
        mp.wait_ready(launched, timeout_s=60)

    if where == "main":
        launch()
    else:
        thread = threading.Thread(target=launch)
        thread.start()
        thread.join()


def hook_chain() -> None:
    """Another library's wrappers around spawnv_passfds, one installed before the hook and one after it."""
    lock = threading.Lock()
    seen: dict[str, list] = {"below": [], "above": []}

    def recorder(where: str, inner):
        @functools.wraps(inner)
        def wrapper(path, args, passfds):
            if any("spawn_main" in str(arg) for arg in args):
                with lock:
                    seen[where].append(os.fsdecode(args[0]))
            return inner(path, args, passfds)

        return wrapper

    multiprocessing.util.spawnv_passfds = recorder("below", multiprocessing.util.spawnv_passfds)
    first = mp.run_ranks_mp(EngineArgs(), target=report_target, placements=[exec_placement(0, 1)], timeout_s=60)
    above = recorder("above", multiprocessing.util.spawnv_passfds)
    multiprocessing.util.spawnv_passfds = above

    cpus: dict[str, list] = {"placed": [first[0].info["cpus"]], "unbound": []}
    errors: list[str] = []

    def launch(kind: str) -> None:
        placement = exec_placement(0, 1) if kind == "placed" else unbound_placement(0)
        try:
            (result,) = mp.run_ranks_mp(EngineArgs(), target=report_target, placements=[placement], timeout_s=60)
            with lock:
                cpus[kind].append(result.info["cpus"])
        except BaseException as exc:  # noqa: BLE001 - reported below
            with lock:
                errors.append(f"{type(exc).__name__}: {str(exc)[:300]}")

    threads = [threading.Thread(target=launch, args=(kind,)) for kind in ("placed", "unbound") * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    from sglang.srt.scheduler_launch.spawn_hook import install_spawn_hook, spawn_hook_installed

    install_spawn_hook()  # again, as every placed launch does: it stays where it is
    _emit(errors=errors, cpus=cpus, above=seen["above"], below=seen["below"],
          top_is_above=multiprocessing.util.spawnv_passfds is above, hook_installed=spawn_hook_installed())


def cpuset(cgroup_dir: str) -> None:
    """Join ``cgroup_dir`` (a cpuset narrower than the placement), then start an in-process rank for CPUs 0-1."""
    with open(os.path.join(cgroup_dir, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    placement = exec_placement(0, 0).replace(cpus=frozenset({0, 1}), strategy="in-process", numactl_args=())
    try:
        (result,) = mp.run_ranks_mp(EngineArgs(), target=report_target, placements=[placement], timeout_s=60)
    except RankLaunchError as exc:
        _emit(ok=False, label=exc.label, message=str(exc))
    else:
        _emit(ok=True, cpus=result.info["cpus"], binding=getattr(result, "binding", None))


SCENARIOS = {
    "narrowed_affinity": narrowed_affinity,
    "prefix_fault": prefix_fault,
    "killed_launcher": killed_launcher,
    "hook_chain": hook_chain,
    "cpuset": cpuset,
}

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    SCENARIOS[sys.argv[1]](*sys.argv[2:])
