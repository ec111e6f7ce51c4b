"""Where a rank's memory lives on a real two-node kernel when sglang's own spawn path starts it.

Boots a fresh two-node VM (tests/numavm.py; node 0 = CPUs 0-1, node 1 =
CPUs 2-3) per measurement, since the page cache and the first pages' node
carry over within a boot. In each, tests/vm_scripts/spawn_path.py spawns one
rank whose placement is on node 1 inside ``configure_subprocess(server_args, gpu_id)``: a GPU rank (GPU 2
of four in a sysfs tree with two GPUs per node, over the VM's real nodes) and
a CPU-device rank (rank 1 of ``SGLANG_CPU_OMP_THREADS_BIND=0-1|2-3``). The
launching process is not pinned: pinning it to node 0 would, rightly, leave a
node-1 rank unbound (its parent's affinity excludes node 1). The
rank touches ``--touch-mb`` MiB and reports /proc/self/numa_maps. Prints the
share of its anonymous resident memory on node 1 (what the rank allocated
itself) and of all its resident memory (file pages included, which sit
wherever the page cache put them).

    python benchmarks/vm_page_locality.py [--devices cuda,cpu] [--touch-mb 64]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import numavm  # noqa: E402

SCRIPT = "tests/vm_scripts/spawn_path.py"
MINIMUM = 0.99


def measure(device: str, touch_mb: int) -> tuple[dict, float]:
    started = time.perf_counter()
    out = numavm.run_script_in_vm(
        SCRIPT,
        *("locality", "--device", device, "--touch-mb", str(touch_mb)),
        vm_args=["--nodes", "2", "--cpus", "4"],
        vm_timeout_s=600,
    )
    return out, time.perf_counter() - started


def share(kb_by_node: dict, node: str) -> float:
    total = sum(kb_by_node.values())
    return kb_by_node.get(node, 0) / total if total else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="cuda,cpu")
    parser.add_argument("--touch-mb", type=int, default=64)
    args = parser.parse_args()
    numavm.require_vm()
    print("one rank on node 1, spawned inside configure_subprocess")
    for device in args.devices.split(","):
        out, elapsed = measure(device, args.touch_mb)
        row = out["row"]
        plan, observed = row["plan"], row["observed"]
        anon, every = share(observed["anon_kb"], "1"), share(
            observed["resident_kb"], "1"
        )
        verdict = "meets" if anon >= MINIMUM else "BELOW"
        print(
            f"  {device:4s} rank (gpu_id {row['gpu_id']}): plan {plan['strategy']} cpus {plan['cpus']} "
            f"{plan['mem_policy']}:{plan['mem_nodes']}; observed cpus {observed['cpus']} policy "
            f"{observed['policy']}:{observed['policy_nodes']}; anonymous pages on node 1 {anon:.2%} ({verdict} "
            f"{MINIMUM:.0%}), all resident pages {every:.2%} (parent cpus {out['parent_cpus']}, VM run {elapsed:.0f} s)"
        )


if __name__ == "__main__":
    main()
