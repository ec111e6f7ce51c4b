"""Where a multiprocessing rank's memory lives on a real two-node kernel: exec (numactl) vs in-process binding.

Boots a fresh two-node VM (../shared/tools/numa-vm, a PCI device on node 1) per
measurement, since the page cache and the first pages' node carry over within a
boot. In each, tests/vm_scripts/mp_page_locality.py plans the device's rank
(node 1: CPUs 2-3, membind 1), re-executes itself pinned to CPU 0 (node 0), and
launches the rank through run_ranks_mp with one strategy; the verify probe
reads /proc/self/numa_maps inside the rank. Prints, per strategy, the share of
the rank's anonymous resident memory on node 1 (what the rank allocated itself;
the figure verify checks) and of all its resident memory (file pages included,
which sit wherever the page cache put them).

    python benchmarks/vm_page_locality.py [--strategies exec,in-process]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NUMA_VM = REPO.parent / "shared" / "tools" / "numa-vm"
SCRIPT = "tests/vm_scripts/mp_page_locality.py"
PCI_ON_NODE_1 = "0000:81:00.0"
MINIMUM = {"exec": 0.99, "in-process": 0.95}


def measure(strategy: str) -> tuple[dict, float]:
    started = time.perf_counter()
    proc = subprocess.run(
        [str(NUMA_VM), "--nodes", "2", "--cpus", "4", "--pci-numa", "1:e1000e", "--timeout", "400", "--",
         sys.executable, SCRIPT, "--gpus", PCI_ON_NODE_1, "--strategies", strategy],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"numa-vm exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    (row,) = json.loads(proc.stdout.strip().splitlines()[-1])["rows"]
    return row, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default="exec,in-process")
    args = parser.parse_args()
    print("rank DP0 PP0 TP0 of PCI device on node 1, launched by run_ranks_mp from a parent pinned to node 0")
    for strategy in args.strategies.split(","):
        row, elapsed = measure(strategy)
        anon, every = row["local_page_ratio"], row["local_page_ratio_all"]
        verdict = "meets" if anon is not None and anon >= MINIMUM.get(strategy, 0) else "BELOW"
        print(
            f"  {strategy:10s} cpus {row['observed_cpus']} policy {row['observed_policy']}: "
            f"anonymous pages on node 1 {anon:.2%} ({verdict} {MINIMUM.get(strategy, 0):.0%}), "
            f"all resident pages {every:.2%}; verify ok={row['ok']} (VM run {elapsed:.0f} s)"
        )


if __name__ == "__main__":
    main()
