"""Cost of planning 64 ranks on an 8-node host snapshot, side by side with an earlier commit.

    .venv/bin/python benchmarks/resolve_cost.py [--repeat 30] [--rounds 2] [--against 5ca3832]

Builds an 8-node sysfs tree (2 packages x 4 nodes, 8 cores x 2 threads and 8 GPUs per node)
and times plan_engine() for tp=8 x dp=8 = 64 ranks, each mode ``--repeat`` times: ``node``
(the default: each GPU's whole node) and ``set-cpu-affinity`` (SGLANG_SET_CPU_AFFINITY=1:
each GPU its slice of its node). ``--against`` runs that commit's own benchmark on the same
machine in the same run, rounds taking turns: its tree is the pristine package with that
commit's overlay (a hard-link copy, in a temporary directory removed afterwards). Its
``exclusive`` mode is the slicing SGLANG_SET_CPU_AFFINITY=1 now does; its ``socket`` and
``core-complex`` modes are gone.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import fakesys  # noqa: E402

from sglang.srt.environ import envs  # noqa: E402
from sglang.srt.placement.facts import FactsHost  # noqa: E402
from sglang.srt.placement.topology import read_topology  # noqa: E402
from sglang.srt.placement.types import ProcessAffinity  # noqa: E402
from sglang.srt.placement_tools import PlanArgs  # noqa: E402
from sglang.srt.placement_tools.engine import plan_engine  # noqa: E402

SHAPE = fakesys.Shape(
    sockets=2, nodes_per_socket=4, cores_per_node=8, threads_per_core=2, gpus_per_node=8
)
MODES = {"node": False, "set-cpu-affinity": True}
OLD_MODE = {"node": "node", "exclusive": "set-cpu-affinity"}  # the earlier names
OLD_LINE = re.compile(r"mode=(\S+)\s+ranks=(\d+) resolve median ([\d.]+) ms")


def time_modes(repeat: int) -> dict[str, float]:
    """Median ms per mode of planning 64 ranks with this tree's code."""
    with tempfile.TemporaryDirectory() as tmp:
        topology = read_topology(fakesys.write_sysfs(Path(tmp) / "sys", SHAPE))
    mems = frozenset(n.node_id for n in topology.nodes)
    affinity = ProcessAffinity(topology.online_cpus, mems, "snapshot")
    args = PlanArgs(tp_size=8, dp_size=8)
    medians = {}
    for mode, slices in MODES.items():
        timings = []
        with envs.SGLANG_SET_CPU_AFFINITY.override(slices):
            for _ in range(repeat):
                start = time.perf_counter()
                host = FactsHost(topology=topology, affinity=affinity, env={})
                placements = plan_engine(args, host=host)
                timings.append((time.perf_counter() - start) * 1e3)
        assert len(placements) == 64 and all(p.bound for p in placements)
        medians[mode] = statistics.median(timings)
    return medians


def earlier_tree(commit: str, into: Path) -> Path:
    """``commit``'s benchmark and package (the pristine one with its overlay) under ``into``."""
    files = ["python", "scripts/overlay.py", "benchmarks/resolve_cost.py", "tests"]
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit, *files],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    site = into / "site"
    site.mkdir()
    shutil.copytree(
        REPO / ".venv" / "pristine" / "sglang", site / "sglang", copy_function=os.link
    )
    subprocess.run(
        [sys.executable, str(into / "scripts" / "overlay.py"), str(site / "sglang")],
        capture_output=True,
        check=True,
    )
    return into


def time_earlier(tree: Path, repeat: int) -> dict[str, float]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(tree / "site"), str(tree / "tests" / "harness")]
    )
    done = subprocess.run(
        [
            sys.executable,
            str(tree / "benchmarks" / "resolve_cost.py"),
            "--repeat",
            str(repeat),
        ],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=tree,
    )
    return {
        m[1]: float(m[3]) for m in map(OLD_LINE.search, done.stdout.splitlines()) if m
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--against", help="an earlier commit, timed alongside")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"now": [], "earlier": []}
    with tempfile.TemporaryDirectory(prefix="resolve-cost-") as tmp:
        tree = earlier_tree(args.against, Path(tmp)) if args.against else None
        for _ in range(args.rounds):
            if tree is not None:
                runs["earlier"].append(time_earlier(tree, args.repeat))
            runs["now"].append(time_modes(args.repeat))
    print(
        f"64 ranks (tp 8 x dp 8) on 8 nodes x 16 CPUs x 8 GPUs; median of {args.repeat} "
        f"plans, {args.rounds} round(s) taking turns; ms per plan of all 64 ranks"
    )
    for i, now in enumerate(runs["now"]):
        line = ", ".join(f"{mode} {ms:.2f}" for mode, ms in now.items())
        print(f"round {i + 1} now:     {line}")
        if runs["earlier"]:
            old = runs["earlier"][i]
            line = ", ".join(f"{mode} {ms:.2f}" for mode, ms in old.items())
            print(f"round {i + 1} {args.against}: {line}")
            for mode, new_mode in OLD_MODE.items():
                ratio = now[new_mode] / old[mode]
                print(f"  {new_mode} now / {mode} at {args.against}: {ratio:.2f}x")
    worst = max(max(now.values()) for now in runs["now"])
    print(f"slowest mode now: {worst:.2f} ms (goal: under 10 ms)")


if __name__ == "__main__":
    main()
