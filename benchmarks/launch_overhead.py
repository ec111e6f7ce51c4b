"""Wall time to launch N scheduler ranks through the multiprocessing launcher, with placement and without.

Both variants use the same launcher (run_ranks_mp) and a trivial target, and
run interleaved (ABBA order) in one process so drift hits both alike. "placed"
starts every rank under numactl (exec); "unplaced" gives every rank strategy
"none". ``--layout node`` (the default, as SGLANG_NUMA_AFFINITY_MODE=node plans
it) binds each rank to all CPUs and the memory of its node, dealing ranks over
the nodes round-robin; ``--layout cpu`` pins each rank to a single CPU, which on
a host with fewer CPUs than ranks also measures the ranks crowding each other.
Also prints the time plan_engine takes for this host, which an engine pays once.

    python benchmarks/launch_overhead.py [--ranks 4] [--reps 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from sglang.srt.scheduler_launch.mp import run_ranks_mp
from sglang.srt.placement.cpulist import format_cpulist
from sglang.srt.placement.types import ProcessPlacement
from sglang.srt.placement.engine_args import EngineArgs


class _Trivial:
    def ready_info(self) -> dict:
        return {"pid": os.getpid()}


def trivial_target(*, server_args, placement, rank):
    return _Trivial()


def _node_of(cpu: int) -> int:
    base = Path("/sys/devices/system/cpu") / f"cpu{cpu}"
    for entry in base.iterdir():
        if entry.name.startswith("node") and entry.name[4:].isdigit():
            return int(entry.name[4:])
    return 0


def placements(ranks: int, *, placed: bool, layout: str = "node") -> list[ProcessPlacement]:
    cpus = sorted(os.sched_getaffinity(0))
    by_node: dict[int, list[int]] = {}
    for cpu in cpus:
        by_node.setdefault(_node_of(cpu), []).append(cpu)
    nodes = sorted(by_node)
    out = []
    for tp in range(ranks):
        if placed:
            if layout == "cpu":
                rank_cpus = [cpus[tp % len(cpus)]]
                node = _node_of(rank_cpus[0])
            else:
                node = nodes[tp % len(nodes)]
                rank_cpus = by_node[node]
            out.append(ProcessPlacement(
                dp_rank=0, pp_rank=0, tp_rank=tp, gpu_id=None, pci=None, numa_node=node, cpus=frozenset(rank_cpus),
                mem_nodes=frozenset({node}), mem_policy="bind", strategy="exec", reasons=("benchmark",),
                numactl_args=(f"--physcpubind={format_cpulist(rank_cpus)}", f"--membind={node}"),
            ))
        else:
            out.append(ProcessPlacement(
                dp_rank=0, pp_rank=0, tp_rank=tp, gpu_id=None, pci=None, numa_node=None, cpus=frozenset(),
                mem_nodes=frozenset(), mem_policy="none", strategy="none", reasons=("benchmark: unplaced",),
            ))
    return out


def time_launch(server_args: EngineArgs, plan: list[ProcessPlacement]) -> float:
    started = time.perf_counter()
    results = run_ranks_mp(server_args, target=trivial_target, placements=plan, timeout_s=300)
    elapsed = time.perf_counter() - started
    assert len(results) == len(plan)
    return elapsed


def time_plan() -> tuple[float, str]:
    from sglang.srt.environ import envs
    from sglang.srt.placement.resolve import plan_engine

    cpus = sorted(os.sched_getaffinity(0))
    spec = "|".join(str(c) for c in cpus)
    with envs.SGLANG_CPU_OMP_THREADS_BIND.override(spec):
        started = time.perf_counter()
        plan = plan_engine(EngineArgs(device="cpu", tp_size=len(cpus)), launcher="mp")
        elapsed = time.perf_counter() - started
    return elapsed, f"device=cpu tp={len(cpus)} SGLANG_CPU_OMP_THREADS_BIND={spec} -> {[p.strategy for p in plan]}"


def time_exec_prefix(prefix: list[str], reps: int = 50) -> float:
    """Median seconds to start and finish ``prefix + [true]``: the per-rank cost numactl adds to a spawn."""
    import shutil
    import subprocess

    argv = [*prefix, shutil.which("true") or "/bin/true"]
    values = []
    for _ in range(reps):
        started = time.perf_counter()
        subprocess.run(argv, check=True)
        values.append(time.perf_counter() - started)
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--layout", choices=("node", "cpu"), default="node")
    args = parser.parse_args()

    server_args = EngineArgs(tp_size=args.ranks)
    variants = {"placed": placements(args.ranks, placed=True, layout=args.layout), "unplaced": placements(args.ranks, placed=False)}
    for plan in variants.values():  # warm-up: imports, resource tracker, page cache
        time_launch(server_args, plan)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(args.reps):
        order = ("placed", "unplaced") if rep % 2 == 0 else ("unplaced", "placed")
        for name in order:
            times[name].append(time_launch(server_args, variants[name]))

    print(f"launch of {args.ranks} ranks through run_ranks_mp, {args.reps} interleaved repetitions each, "
          f"layout {args.layout} (host: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, "
          f"Python {sys.version.split()[0]})")
    print(f"  placed ranks: {', '.join(' '.join(p.numactl_args) for p in variants['placed'])}")
    for name, values in times.items():
        print(f"  {name:9s} median {statistics.median(values) * 1000:8.1f} ms   mean {statistics.mean(values) * 1000:8.1f} ms"
              f"   min {min(values) * 1000:8.1f} ms   max {max(values) * 1000:8.1f} ms")
    med_p, med_u = statistics.median(times["placed"]), statistics.median(times["unplaced"])
    mean_p, mean_u = statistics.mean(times["placed"]), statistics.mean(times["unplaced"])
    min_p, min_u = min(times["placed"]), min(times["unplaced"])
    # Each repetition runs both variants back to back: their ratio cancels load that drifts between repetitions.
    paired = statistics.median(p / u for p, u in zip(times["placed"], times["unplaced"]))
    print(f"  overhead  median {100 * (med_p - med_u) / med_u:+.1f}%   mean {100 * (mean_p - mean_u) / mean_u:+.1f}%"
          f"   best {100 * (min_p - min_u) / min_u:+.1f}%   paired median {100 * (paired - 1):+.1f}%"
          f"   (target: at most +5%)")
    from sglang.srt.placement.numactl import numactl_prefix

    bare = time_exec_prefix([])
    wrapped = time_exec_prefix(numactl_prefix(variants["placed"][0]))
    print(f"  numactl exec per rank: {(wrapped - bare) * 1000:.2f} ms "
          f"(median start-to-exit of `true` {bare * 1000:.2f} ms bare, {wrapped * 1000:.2f} ms under numactl)")
    plan_s, what = time_plan()
    print(f"  plan_engine once per engine: {plan_s * 1000:.1f} ms ({what})")


if __name__ == "__main__":
    main()
