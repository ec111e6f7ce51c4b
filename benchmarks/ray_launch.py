"""What placement costs a RayEngine launch: the same 4-rank engine placed and unplaced, interleaved, on one cluster.

Run (after scripts/setup.sh): .venv/bin/python benchmarks/ray_launch.py [--repeat N]
[--modes placed,unplaced]

A local cluster declares 4 GPUs on this CPU host; its raylet reads a fake /sys
(the test harness's ``ray_gpu_cluster.fake_host_env``, ``two_numa_nodes``): GPUs 0
and 1 on NUMA node 0, GPUs 2 and 3 on node 1, each node holding one real CPU of this
host, so a placed launch really binds. Each launch does what
``RayEngine._launch_scheduler_processes`` does: it reserves the engine's
placement group (one bundle of 4 GPUs), then calls upstream's
``sglang.srt.ray.engine._create_scheduler_actor`` once per rank, then waits for
every actor's ``get_info``. The actors are sglang's own ``SchedulerActor``, its
``configure_scheduler_process`` binding it, with the tests' stand-in scheduler module
(no model; the real one would add the same 20 s engine import to both modes). Modes:

* ``placed``: each actor places the GPU Ray gave it and binds itself
  in-process (every thread, memory policy, pages migrated).
* ``unplaced``: the same actor for a device sglang does not place.

Each launch is timed from reserving the placement group until every actor is
ready (shutdown is printed apart), once the previous launch's GPUs are free
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
import unittest.mock
from typing import Any

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
)
sys.path.insert(
    0,
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "harness"),
)
import fakesys  # noqa: E402
import ray  # noqa: E402
import sglang_light  # noqa: E402,F401  (sglang's own __init__ costs seconds and nothing here uses it)
from ray.util.placement_group import (  # noqa: E402
    placement_group,
    remove_placement_group,
)
from ray_gpu_cluster import fake_host_env, two_numa_nodes  # noqa: E402

RANKS = 4
PHASES = ("placement_group_s", "first_call_s", "other_calls_s", "ready_s")


TINY_MODEL = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "tiny_llama"
)


MODES = ("placed", "unplaced")


def engine_args(mode: str) -> Any:
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=TINY_MODEL, tp_size=RANKS, device="cuda")
    if mode == "unplaced":
        args.device = (
            "unplaced"  # a device sglang does not place: nothing is read or bound
        )
    return args


def wait_released(gpus: float, *, limit_s: float = 60.0) -> None:
    """Wait (untimed) until the previous launch's GPUs are free again, so every launch starts alike."""
    deadline = time.monotonic() + limit_s
    while (
        ray.available_resources().get("GPU", 0) < gpus and time.monotonic() < deadline
    ):
        time.sleep(0.02)


def one_launch(mode: str) -> dict[str, Any]:
    import sglang.srt.ray.engine as engine

    wait_released(RANKS)
    server_args = engine_args(mode)
    timings: dict[str, Any] = {}
    started = time.perf_counter()
    pg = placement_group([{"CPU": 1, "GPU": RANKS}], strategy="STRICT_PACK")
    actors = []
    try:
        ray.get(pg.ready(), timeout=120)
        timings["placement_group_s"] = time.perf_counter() - started
        for tp_rank in range(RANKS):
            t = time.perf_counter()
            actors.append(engine._create_scheduler_actor(
                pg=pg, bundle_idx=0, gpu_id=tp_rank, server_args=server_args, port_args=None,
                tp_rank=tp_rank, pp_rank=0, dp_rank=0, dist_init_addr="127.0.0.1:0",
                rank0_node_ip="127.0.0.1",
            ))  # fmt: skip
            key = "first_call_s" if tp_rank == 0 else "other_calls_s"
            timings[key] = timings.get(key, 0.0) + time.perf_counter() - t
        t = time.perf_counter()
        reports = ray.get([a.get_info.remote() for a in actors], timeout=300)
        timings["ready_s"] = time.perf_counter() - t
        timings["launch_s"] = time.perf_counter() - started
    finally:
        t = time.perf_counter()
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(pg)
        timings["shutdown_s"] = time.perf_counter() - t
    strategies = {r["placement"]["strategy"] for r in reports}
    timings["strategy"] = ",".join(sorted(strategies))
    return timings


def run_modes(
    modes: list[str], *, repeat: int, tree: os.PathLike
) -> dict[str, list[dict]]:
    """Every mode ``repeat`` times on one local cluster whose raylet reads ``tree``."""
    t = time.perf_counter()
    # The local raylet, and so its workers, inherit these; this process keeps its own environment.
    with unittest.mock.patch.dict(os.environ, {**fake_host_env(str(tree)), "RAY_memory_monitor_refresh_ms": "0",
                         "PYTHONPATH": os.pathsep.join(sys.path[:2])}):  # fmt: skip
        ray.init(address="local", num_cpus=2, num_gpus=RANKS, include_dashboard=False,
                 configure_logging=False, log_to_driver=False,
                 runtime_env={"worker_process_setup_hook": "upstream_standins.install"})  # fmt: skip
    print(f"ray.init: {time.perf_counter() - t:.2f} s; fake /sys {tree}")
    try:
        t = time.perf_counter()
        one_launch(
            modes[0]
        )  # warm-up: imports the engine here and the modules in the workers
        print(f"warm-up launch ({modes[0]}): {time.perf_counter() - t:.2f} s")
        runs: dict[str, list[dict]] = {mode: [] for mode in modes}
        for i in range(repeat):
            order = modes[i % len(modes) :] + modes[: i % len(modes)]
            for mode in order:
                r = one_launch(mode)
                runs[mode].append(r)
                phases = ", ".join(
                    f"{k.removesuffix('_s')} {r[k] * 1000:.0f}"
                    for k in (*PHASES, "launch_s", "shutdown_s")
                    if k in r
                )
                print(
                    f"rep {i + 1} {mode:10s} ({r['strategy']}): {phases} ms", flush=True
                )
        return runs
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--modes",
        default="placed,unplaced",
        help=f"comma-separated, of {', '.join(MODES)}",
    )
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown or args.repeat < 1:
        parser.error(
            f"--modes takes {', '.join(MODES)} (got {unknown}); --repeat must be at least 1"
        )
    directory = tempfile.mkdtemp(prefix="sglr-bench-", dir="/tmp")
    try:
        tree = fakesys.write_sysfs(os.path.join(directory, "sys"), two_numa_nodes())
        runs = run_modes(modes, repeat=args.repeat, tree=tree)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print()
    medians = {
        mode: statistics.median(r["launch_s"] for r in rs) for mode, rs in runs.items()
    }
    for mode, rs in runs.items():
        phases = ", ".join(
            f"{k.removesuffix('_s')} {statistics.median(r[k] for r in rs) * 1000:.0f}"
            for k in PHASES
            if k in rs[0]
        )
        print(f"median {mode:10s}: launch {medians[mode] * 1000:.0f} ms ({phases} ms)")
    if "unplaced" in medians:
        for mode in medians:
            if mode != "unplaced":
                print(
                    f"median ratio {mode}/unplaced: {medians[mode] / medians['unplaced']:.2f}"
                )


if __name__ == "__main__":
    main()
