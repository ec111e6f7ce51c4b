"""Wall time to launch N scheduler ranks through sglang's spawn path, placed and as upstream leaves them.

Each rank is started as ``Engine._launch_scheduler_processes`` starts one: a
spawn-context ``Process`` whose ``start()`` runs inside
``numa_utils.configure_subprocess(server_args, gpu_id)``; a launch ends when
every rank has reported ready over its pipe. The ranks are CPU-device ranks
(this host has no GPU): "placed" gives each its own CPU group
(``SGLANG_CPU_OMP_THREADS_BIND``), so each starts under numactl;
"upstream" sets ``SGLANG_NUMA_BIND_V2=0``, where ``configure_subprocess`` does
nothing, as in sglang 0.5.23. The two run interleaved (ABBA) in one process so
drift hits both alike; the paired ratio is the median of placed/upstream over
neighbouring launches. The extra time per rank is what binding costs whatever the rank
does afterwards (mostly numactl's own exec), so its share of a real scheduler's launch,
which loads a model, is far smaller than of these ranks, which only report ready.

    python benchmarks/launch_overhead.py [--ranks 2] [--reps 20]
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import statistics
import sys
import time
from multiprocessing import resource_tracker
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "harness"))
import rank_probe  # noqa: E402  (sglang's ServerArgs for a model config in tests/data)

GOAL = 1.05


def ready(writer) -> None:
    writer.send(os.getpid())
    writer.close()


def launch(server_args, ranks: int) -> float:
    from sglang.srt.utils import numa_utils

    ctx = multiprocessing.get_context("spawn")
    started = time.perf_counter()
    procs = []
    for gpu_id in range(ranks):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=ready, args=(writer,))
        with numa_utils.configure_subprocess(server_args, gpu_id):
            proc.start()
        writer.close()
        procs.append((proc, reader))
    for proc, reader in procs:
        reader.recv()
    elapsed = time.perf_counter() - started
    for proc, reader in procs:
        proc.join()
        reader.close()
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    cpus = sorted(os.sched_getaffinity(0))
    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(
        str(cpus[i % len(cpus)]) for i in range(args.ranks)
    )
    multiprocessing.set_start_method("spawn", force=True)  # as sglang's Engine does
    # A process's first spawn also starts multiprocessing's resource tracker with the
    # spawn executable then in force: started here, outside both modes.
    resource_tracker.ensure_running()
    server_args = rank_probe.server_args(device="cpu", tp_size=args.ranks)
    times: dict[str, list[float]] = {"placed": [], "upstream": []}

    def run(mode: str) -> None:
        os.environ["SGLANG_NUMA_BIND_V2"] = "1" if mode == "placed" else "0"
        times[mode].append(launch(server_args, args.ranks))

    run("placed")
    run("upstream")  # warm-up: first spawns pay for the page cache
    times = {"placed": [], "upstream": []}
    for rep in range(args.reps):
        order = ("placed", "upstream") if rep % 2 == 0 else ("upstream", "placed")
        for mode in order:
            run(mode)
    placed, upstream = statistics.median(times["placed"]), statistics.median(
        times["upstream"]
    )
    paired = statistics.median(
        p / u for p, u in zip(times["placed"], times["upstream"])
    )
    print(
        f"{args.ranks} CPU-device ranks through configure_subprocess, {args.reps} launches each (ABBA), "
        f"python {sys.version.split()[0]}, {len(cpus)} CPUs"
    )
    print(
        f"median launch: placed (exec under numactl) {placed * 1000:.1f} ms, upstream (no binding) "
        f"{upstream * 1000:.1f} ms"
    )
    extra = statistics.median(
        (p - u) / args.ranks for p, u in zip(times["placed"], times["upstream"])
    )
    print(
        f"median ratio {placed / upstream:.3f}, paired median ratio {paired:.3f} (goal <= {GOAL}); "
        f"paired median extra time per rank {extra * 1000:.2f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
