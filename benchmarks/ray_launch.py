"""Where the time of a Ray launch goes: placement group, per-rank resolve task, actor start, shutdown.

Run: .venv/bin/python benchmarks/ray_launch.py [--repeat N]
Two CPU-device ranks (SGLANG_CPU_OMP_THREADS_BIND="0|1") on a local 2-CPU cluster.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import ray

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import ray_helpers  # noqa: E402

from sglang.srt.scheduler_launch.ray_launcher import launch_scheduler_actors, shutdown_ray, wait_ready_ray, wait_finished_ray  # noqa: E402
from sglang.srt.placement.engine_args import EngineArgs  # noqa: E402


def one_launch(*, force_in_process: bool) -> dict[str, float]:
    started = time.perf_counter()
    launch = launch_scheduler_actors(
        EngineArgs(tp_size=2, device="cpu"), target=ray_helpers.reporting_target, timeout_s=120,
        force_in_process=force_in_process,
    )
    try:
        wait_ready_ray(launch, timeout_s=120)
        wait_finished_ray(launch, timeout_s=120)
    finally:
        t = time.perf_counter()
        shutdown_ray(launch)
        launch.timings["shutdown_s"] = time.perf_counter() - t
    launch.timings["total_s"] = time.perf_counter() - started
    launch.timings["in_task_resolve_s"] = max(a.resolve_s for a in launch.actors)
    return launch.timings


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "0|1"
    ray.cloudpickle.register_pickle_by_value(ray_helpers)
    t = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    print(f"ray.init: {time.perf_counter() - t:.2f} s")
    # The first launch finds Ray's prestarted workers idle; later ones usually do not (the actors of
    # the previous launch counted against the worker soft limit, so idle workers were reaped).
    for mode, force in (("exec", False), ("in-process", True)):
        runs = [one_launch(force_in_process=force) for _ in range(args.repeat)]
        for i, r in enumerate(runs):
            print(f"{mode} launch {i + 1} (2 ranks): " + ", ".join(f"{k}={v * 1000:.0f} ms" for k, v in r.items()))
        print(f"{mode} median resolve step: {statistics.median(r['resolve_s'] for r in runs) * 1000:.0f} ms, "
              f"median ready: {statistics.median(r['ready_s'] for r in runs) * 1000:.0f} ms")
    ray.shutdown()


if __name__ == "__main__":
    main()
