"""Where a rank's memory is on a real two-node kernel: spawned by sglang (exec under
numactl), unbound, or binding itself late (in-process).

Boots a fresh two-node VM (tests/numavm.py: node 0 = CPUs 0-1, node 1 = CPUs 2-3, a
PCI device on node 1) per mode, since the page cache and where a process's first pages
land carry over within a boot, and runs tests/vm_scripts/spawn_locality.py there: a
CPU-device rank of each node (SGLANG_CPU_OMP_THREADS_BIND=0-1|2-3) and a GPU rank whose
stand-in NVML GPU is the PCI device on node 1. Modes:

* exec: spawned inside ``configure_subprocess`` (sglang's spawn path): under numactl
  from its first instruction.
* unbound: spawned without a placement; it touches --touch-mb MiB running on node 0,
  then as much again.
* in-process: the same, but it binds itself to its node (``numa_bind_to_node``, the
  in-process strategy of a Ray actor or of a spawn whose numactl wrapper cannot run)
  between the two touches.

Prints, per mode and rank, the share of the rank's anonymous resident memory (what it
allocated itself) on its node, and of all its resident memory (file pages sit wherever
the page cache put them).

    .venv/bin/python benchmarks/vm_page_locality.py [--modes exec,unbound,in-process]
                                                    [--touch-mb 64]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import numavm  # noqa: E402

SCRIPT = "tests/vm_scripts/spawn_locality.py"
VM = ["--nodes", "2", "--cpus", "4", "--pci-node", "1"]
GOAL = 0.99  # the exec path's share of anonymous memory on the rank's node


def share(kb_by_node: dict, node: int) -> float:
    total = sum(kb_by_node.values())
    return kb_by_node.get(str(node), 0) / total if total else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="exec,unbound,in-process")
    parser.add_argument("--touch-mb", type=int, default=64)
    args = parser.parse_args()
    numavm.require_vm()
    print(
        f"{'mode':<11} {'rank':<5} {'node':>4} {'cpus':<8} {'policy':<12} "
        f"{'anon on node':>12} {'all on node':>11} {'anon MiB':>8}  VM s"
    )
    for mode in args.modes.split(","):
        started = time.perf_counter()
        out = numavm.run_script_in_vm(
            SCRIPT,
            *("--mode", mode, "--touch-mb", str(args.touch_mb)),
            vm_args=VM,
            vm_timeout_s=900,
        )
        elapsed = time.perf_counter() - started
        for row in out["ranks"]:
            report, node = row["report"], row["node"]
            policy = f"{report['policy']}:{','.join(map(str, report['policy_nodes']))}"
            cpus = ",".join(map(str, report["cpus"]))
            anon_mib = sum(report["anon_kb"].values()) / 1024
            print(
                f"{mode:<11} {row['rank']:<5} {node:>4} {cpus:<8} {policy:<12} "
                f"{share(report['anon_kb'], node):>12.1%} "
                f"{share(report['resident_kb'], node):>11.1%} {anon_mib:>8.0f}  "
                f"{elapsed:.0f}"
            )
    print(
        f"(goal for exec: {GOAL:.0%} of anonymous memory on the rank's node; "
        f"{args.touch_mb} MiB touched per rank, twice for unbound and in-process; "
        "TCG emulation)"
    )


if __name__ == "__main__":
    main()
