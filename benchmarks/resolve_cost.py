"""What deciding a rank's placement costs: ``numa_utils.resolve_placement`` for every
rank of a dp2 x tp8 engine on a two-node host with eight GPUs per node.

Runs itself on a fake host (tests/fakehost.py: a sysfs tree mounted in a private mount
namespace, a stand-in NVML; needs root): node 0 holds this machine's CPU 0, node 1 its
CPU 1, each with 15 CPUs this machine lacks, so numactl really probes each rank's
binding (node 1's memory binding is refused here and the ladder goes down to its
CPUs, as where a node's memory cannot be bound). Times each mode ``--repeat`` times:
``node`` (each GPU's whole node) and ``set-cpu-affinity``
(SGLANG_SET_CPU_AFFINITY=1: each GPU's slice of its node, which asks NVML about every
GPU and reads lscpu). The decision runs once per rank, in the engine's launching process,
before the rank's spawn; what it costs is mostly the numactl probe.

    sudo .venv/bin/python benchmarks/resolve_cost.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "harness")]
GPUS_PER_NODE = 8
MODES = {"node": "0", "set-cpu-affinity": "1"}


def host():
    import fakesys

    real = sorted(os.sched_getaffinity(0))[:2]
    lacking = iter(range(64, 96))
    nodes = {
        n: fakesys.NodeSpec(cpus=[cpu] + [next(lacking) for _ in range(15)])
        for n, cpu in enumerate(real)
    }
    gpus = [
        fakesys.PciSpec(fakesys.gpu_address(i), i // GPUS_PER_NODE)
        for i in range(2 * GPUS_PER_NODE)
    ]
    return fakesys.Host(nodes=nodes, pci=[fakesys.host_bridge(0), *gpus])


def inside(repeat: int) -> dict:
    """The timings, on the fake host (this process is in its namespace)."""
    import rank_probe

    from sglang.srt.utils import numa_utils

    logging.disable(logging.WARNING)  # the ladder's warnings, once per rank
    server_args = rank_probe.server_args(device="cuda", tp_size=8, dp_size=2)
    ranks = [r for group in rank_probe.engine_ranks(server_args) for r in group]
    out = {}
    for mode, value in MODES.items():
        os.environ["SGLANG_SET_CPU_AFFINITY"] = value
        engine_ms, strategies = [], set()
        for _ in range(repeat):
            started = time.perf_counter()
            for rank in ranks:
                placement = numa_utils.resolve_placement(server_args, rank.gpu_id)
                strategies.add(placement.strategy)
            engine_ms.append((time.perf_counter() - started) * 1e3)
        out[mode] = {"engine_ms": engine_ms, "strategies": sorted(strategies)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        print(json.dumps(inside(args.repeat)))
        return
    import fakehost
    import fakesys

    gpus = [fakesys.gpu_address(i) for i in range(2 * GPUS_PER_NODE)]
    argv = [sys.executable, __file__, "--inside", "--repeat", str(args.repeat)]
    env = fakehost.gpu_env(gpus, PYTHONPATH=str(TESTS / "harness"))
    done = fakehost.run(host(), argv, env=env, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(
            f"resolve_cost on the fake host failed:\n{done.stderr[-3000:]}"
        )
    timings = json.loads(done.stdout.strip().splitlines()[-1])
    ranks = 2 * GPUS_PER_NODE
    print(
        f"resolve_placement for the {ranks} ranks of dp2 x tp8 on 2 nodes x "
        f"{GPUS_PER_NODE} GPUs, median of {args.repeat}"
    )
    for mode, result in timings.items():
        median = statistics.median(result["engine_ms"])
        print(
            f"{mode:<17} {median:8.1f} ms per engine, {median / ranks:6.2f} ms per "
            f"rank (strategies: {', '.join(result['strategies'])})"
        )


if __name__ == "__main__":
    main()
