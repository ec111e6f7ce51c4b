"""What placement costs a Ray launch: the same 4-actor engine placed and unplaced, in turns,
on one local cluster of two raylets on a fake two-node GPU host.

Run as root (the fake host is a mount namespace), after scripts/setup.sh:

    .venv/bin/python benchmarks/ray_launch.py [--repeat N]

The cluster is the tests' (``tests/ray_gpu_cluster.py``): raylet ``a`` holds host
GPUs 0 and 1 (NUMA node 0), raylet ``b`` GPUs 2 and 3 (node 1), each node one real
CPU of this machine. Each launch is one Ray job doing what RayEngine does: it reserves
a placement group (a bundle of 2 GPUs per raylet), creates 4 actors with sglang's own
``_create_scheduler_actor`` and waits for each ``get_info``; the actors are sglang's
``SchedulerActor`` whose ``Scheduler`` alone is stood in. Modes:

* ``placed``: each actor resolves its GPU's node and binds itself in-process (every
  thread, preferred memory);
* ``unplaced``: the same with ``SGLANG_AUTO_NUMA_BIND=0``: no node, nothing bound.

Launches run one at a time, the modes alternating, after one warm-up launch. Printed
per launch: its wall time (placement group to the last report) and the CPU seconds of
each actor's process once its Scheduler was built.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
sys.path[:0] = [TESTS, os.path.join(TESTS, "harness")]

from ray_gpu_cluster import nvml_gpus, run_plan  # noqa: E402

MODES = {"placed": {}, "unplaced": {"SGLANG_AUTO_NUMA_BIND": "0"}}
RAYLETS = [
    {"name": name, "num_gpus": 2,
     "env": {"FAKE_NVML_GPUS": nvml_gpus([0, 1, 2, 3]),
             "PLACEMENT_TESTS_PLATFORM": "cuda", "CUDA_VISIBLE_DEVICES": visible}}
    for name, visible in (("a", "0,1"), ("b", "2,3"))
]  # fmt: skip


def launch(name: str, mode: str) -> dict:
    return {
        "name": name,
        "package": "overlaid",
        "env_vars": MODES[mode],
        "server_args": {"tp_size": 4, "device": "cuda"},
        "actors": [{"raylet": r, "tp_rank": i} for i, r in enumerate("aabb")],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: give at least 1")
    modes = list(MODES)
    jobs = [launch("warm-up", "placed")]
    for i in range(args.repeat):
        for mode in modes[i % 2 :] + modes[: i % 2]:
            jobs.append(launch(f"{mode} {i + 1}", mode))
    result = run_plan({"raylets": RAYLETS, "jobs": jobs, "concurrent": False})
    timings = result["timings"]
    print(f"cluster start: {timings['cluster_s']:.1f} s")
    walls: dict[str, list[float]] = {mode: [] for mode in modes}
    for job in jobs:
        reports = result["jobs"][job["name"]]
        errors = [r["error"] for r in reports if "error" in r]
        if errors:
            raise SystemExit(f"{job['name']}: {errors[0]}")
        wall = timings["job_s"][job["name"]]
        cpu = ", ".join(f"{r['cpu_s']:.1f}" for r in reports)
        placed = sorted({line.split("strategy='")[1].split("'")[0]
                         for r in reports for line in r["placement_log"]
                         if "strategy='" in line})  # fmt: skip
        print(f"{job['name']:10s} {wall:6.1f} s; actor CPU s {cpu}; {placed}")
        if job["name"] != "warm-up":
            walls[job["name"].split()[0]].append(wall)
    for mode, values in walls.items():
        print(f"median {mode:9s} {statistics.median(values):6.1f} s")


if __name__ == "__main__":
    main()
