"""Inside a multi-NUMA VM: touch memory on node 0, bind in process to node 1, report where pages are.

Plain Python only (no torch): under emulation every import is slow. Prints one
JSON object on its last line of stdout.

    python tests/vm_scripts/inprocess_bind.py [--no-migrate] [--mib 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "harness")
)
import threading
import time

import sglang_light  # noqa: E402,F401  (first: placement without sglang's own __init__)

_PINNED_MARK = "SGLANG_VM_SCRIPT_PINNED"


def _touch(mib: int) -> bytearray:
    buf = bytearray(mib << 20)
    # One write per page, so every page is really faulted in (first touch decides its node).
    buf[::4096] = b"\x01" * len(range(0, len(buf), 4096))
    return buf


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--node", type=int, default=1)
    parser.add_argument("--cpus", default="2-3")
    parser.add_argument("--start-cpu", type=int, default=0)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--no-migrate", action="store_true")
    args = parser.parse_args()

    if os.environ.get(_PINNED_MARK) != "1":
        # Restart pinned, so the interpreter's own pages also land on the start CPU's node.
        os.sched_setaffinity(0, {args.start_cpu})
        os.environ[_PINNED_MARK] = "1"
        os.execv(sys.executable, [sys.executable, *sys.argv])

    from sglang.srt.placement.apply import bind_in_process
    from sglang.srt.placement.cpulist import parse_cpulist
    from sglang.srt.placement_tools.observe import compare_binding, observe_self
    from sglang.srt.placement.types import ProcessPlacement, RankIdentity

    early = _touch(args.mib)
    # A thread already running at bind time: its memory policy stays default (only the calling
    # thread's policy is set), so its pages are local only because its CPUs moved too.
    go = threading.Event()
    worker_result: dict = {}

    def worker() -> None:
        go.wait()
        worker_result["cpus"] = sorted(os.sched_getaffinity(0))
        worker_result["buf"] = _touch(max(1, args.mib // 4))

    thread = threading.Thread(target=worker)
    thread.start()
    before = observe_self()

    placement = ProcessPlacement(
        rank=RankIdentity(dp_rank=0, pp_rank=0, tp_rank=0, gpu_id=None),
        pci=None,
        numa_node=args.node,
        cpus=parse_cpulist(args.cpus),
        mem_nodes=frozenset({args.node}),
        mem_policy="bind",
        strategy="in-process",
        reasons=("vm test",),
    )
    started = time.monotonic()
    outcome = bind_in_process(placement, migrate=not args.no_migrate)
    bind_seconds = time.monotonic() - started
    after_bind = observe_self()

    go.set()
    thread.join()
    late = _touch(args.mib)
    after = observe_self()
    target = [args.node]
    print(
        json.dumps(
            {
                "summary": outcome.summary,
                "pages_not_migrated": outcome.pages_not_migrated,
                "bind_seconds": round(bind_seconds, 3),
                "ratio_before": before.local_page_ratio(target),
                "ratio_after_bind": after_bind.local_page_ratio(target),
                "ratio_after_alloc": after.local_page_ratio(target),
                "anon_ratio_after_alloc": after.local_page_ratio(
                    target, anon_only=True
                ),
                "observed": after.to_dict(),
                "diffs": compare_binding(placement, after),
                "worker_cpus": worker_result["cpus"],
                "touched_mib": (len(early) + len(late) + len(worker_result["buf"]))
                >> 20,
            }
        )
    )


if __name__ == "__main__":
    main()
