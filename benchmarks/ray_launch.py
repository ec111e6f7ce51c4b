"""What placement costs a Ray launch: the same 4-rank engine placed and unplaced, interleaved, on one cluster.

Run (after scripts/setup.sh): .venv/bin/python benchmarks/ray_launch.py [--repeat N] [--modes placed,in-process,unplaced]

A local cluster declares 4 GPUs on this CPU host; its raylet reads a fake /sys
(SGLANG_SYSFS_ROOT) holding this host's CPUs (padded to 8) and the 4 GPUs on
node 0 plus a GPU-less node 1, so a placed launch really binds: every rank
starts under ``numactl --physcpubind=<this host's CPUs> --membind=0``. Modes:

* ``placed``: the planning round (a probe per bundle, a resolve per node), actors under numactl (exec).
* ``in-process``: the same round, actors bind themselves with libnuma.
* ``unplaced``: ``placement=False``, unbound actors, no round.

Each launch is timed from reserving the placement group until every actor
is ready (shutdown is printed apart), once the previous launch's GPUs are free
again. Modes take turns within a repetition, in a rotating order, so that a
warm or cold worker pool favours none.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import fakesys  # noqa: E402
import ray  # noqa: E402
import ray_helpers  # noqa: E402
from ray_gpu_cluster import tree_spec  # noqa: E402

from sglang.srt.scheduler_launch.ray_launcher import (  # noqa: E402
    launch_scheduler_actors,
    shutdown_ray,
    wait_ready_ray,
)
from sglang.srt.placement.engine_args import EngineArgs  # noqa: E402

MODES = {"placed": {}, "in-process": {"force_in_process": True}, "unplaced": {"placement": False}}
PHASES = ("placement_group_s", "plan_s", "node_resolve_s", "create_s", "ready_s")


def wait_released(gpus: float, *, limit_s: float = 30.0) -> None:
    """Wait (untimed) until the previous launch's GPUs are free again, so every launch starts from one state."""
    deadline = time.monotonic() + limit_s
    while ray.available_resources().get("GPU", 0) < gpus and time.monotonic() < deadline:
        time.sleep(0.02)


def one_launch(options: dict) -> dict[str, float]:
    wait_released(4)
    started = time.perf_counter()
    launch = launch_scheduler_actors(EngineArgs(tp_size=4, device="cuda"), target=ray_helpers.reporting_target,
                                     timeout_s=120, **options)
    try:
        results = wait_ready_ray(launch, timeout_s=120)
        launch.timings["launch_s"] = time.perf_counter() - started
    finally:
        t = time.perf_counter()
        shutdown_ray(launch)
        launch.timings["shutdown_s"] = time.perf_counter() - t
    strategies = {r.placement.strategy.value if r.placement else "unplaced" for r in results}
    return {**launch.timings, "strategy": ",".join(sorted(strategies))}


def run_modes(modes: list[str], *, repeat: int, tree: os.PathLike) -> dict[str, list[dict]]:
    """Every mode ``repeat`` times on one local cluster whose raylet reads ``tree``; the timings per mode."""
    os.environ["SGLANG_SYSFS_ROOT"] = str(tree)  # the local raylet, and so its workers, inherit it
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")  # a shared host's other users must not kill ranks
    ray.cloudpickle.register_pickle_by_value(ray_helpers)
    t = time.perf_counter()
    ray.init(address="local", num_cpus=2, num_gpus=4, include_dashboard=False, configure_logging=False,
             log_to_driver=False)
    print(f"ray.init: {time.perf_counter() - t:.2f} s; fake /sys {tree}")
    try:
        one_launch(MODES[modes[0]])  # warm-up: the first launch also imports the modules in the workers
        runs: dict[str, list[dict]] = {mode: [] for mode in modes}
        for i in range(repeat):
            order = modes[i % len(modes):] + modes[:i % len(modes)]
            for mode in order:
                r = one_launch(MODES[mode])
                runs[mode].append(r)
                phases = ", ".join(f"{k.removesuffix('_s')} {r[k] * 1000:.0f}"
                                   for k in (*PHASES, "launch_s", "shutdown_s") if k in r)
                print(f"rep {i + 1} {mode:10s} ({r['strategy']}): {phases} ms")
        return runs
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--modes", default="placed,unplaced", help=f"comma-separated, of {', '.join(MODES)}")
    args = parser.parse_args()
    modes = args.modes.split(",")
    directory = tempfile.mkdtemp(prefix="sglr-bench-")
    try:
        runs = run_modes(modes, repeat=args.repeat, tree=fakesys.write_sysfs(os.path.join(directory, "sys"),
                                                                              tree_spec([0, 1, 2, 3])))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print()
    medians = {mode: statistics.median(r["launch_s"] for r in rs) for mode, rs in runs.items()}
    for mode, rs in runs.items():
        phases = ", ".join(f"{k.removesuffix('_s')} {statistics.median(r[k] for r in rs) * 1000:.0f}"
                           for k in PHASES if k in rs[0])
        print(f"median {mode:10s}: launch {medians[mode] * 1000:.0f} ms ({phases} ms)")
    if "unplaced" in medians:
        for mode in medians:
            if mode != "unplaced":
                print(f"median ratio {mode}/unplaced: {medians[mode] / medians['unplaced']:.2f}")


if __name__ == "__main__":
    main()
