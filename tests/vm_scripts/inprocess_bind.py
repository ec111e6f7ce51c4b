"""Inside a multi-NUMA VM: a Ray scheduler actor's bind, after torch, from node 0 to node 1.

The process pins itself to cpu 0 (node 0), imports torch (as a Ray worker has
by the time its actor binds), touches memory, private and shared (as another rank's
segment or a library's page cache), then runs what sglang's ``SchedulerActor`` runs
to bind itself (``configure_scheduler_process``'s ``bind_scheduler_process``, in a
process that Ray's runtime context, faked, calls an actor of Ray's GPU 1) with
``--numa-node 0 1`` (the VM has no GPU to discover), and reports where its pages
are. ``--no-migrate`` applies the same placement without moving pages, for
comparison. Prints one JSON object on its last line of stdout.

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


def _shared_ratio(nodes: list[int]) -> float:
    """Share of the shared anonymous mapping's pages on ``nodes`` (it must not move)."""
    with open("/proc/self/numa_maps") as f:
        line = next(line for line in f if "file=/dev/zero" in line)
    counts = {
        int(k[1:]): int(v)
        for k, v in (w.split("=") for w in line.split() if w[:1] == "N")
    }
    return sum(counts.get(n, 0) for n in nodes) / sum(counts.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--node", type=int, default=1)
    parser.add_argument("--start-cpu", type=int, default=0)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--no-migrate", action="store_true")
    args = parser.parse_args()

    if os.environ.get(_PINNED_MARK) != "1":
        # Restart pinned, so the interpreter's own pages also land on the start CPU's node.
        os.sched_setaffinity(0, {args.start_cpu})
        os.environ[_PINNED_MARK] = "1"
        os.execv(sys.executable, [sys.executable, *sys.argv])

    started = time.monotonic()
    import torch  # noqa: F401

    torch_seconds = time.monotonic() - started
    import mmap
    import types

    sglang_light.bare_package("sglang.srt.utils")
    from sglang.srt.placement_tools.verify import compare_binding, observe_self
    from sglang.srt.utils import numa_utils

    # Ray's runtime context of an actor holding Ray's GPU ``args.node``.
    ray = types.ModuleType("ray")
    ray.is_initialized = lambda: True
    ray.get_runtime_context = lambda: types.SimpleNamespace(
        get_actor_id=lambda: "actor",
        get_accelerator_ids=lambda: {"GPU": [str(args.node)]},
    )
    sys.modules["ray"] = ray
    server_args = types.SimpleNamespace(numa_node=[0, args.node], tp_size=2)
    early = _touch(args.mib)
    shared = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_SHARED)
    shared.write(b"\x01" * (8 << 20))
    # From here on as a Ray worker that happened to start on node 0: its pages are
    # there, and it may run on every CPU of its raylet.
    os.sched_setaffinity(0, range(os.cpu_count() or 1))
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

    started = time.monotonic()
    if args.no_migrate:  # what migration buys: the same bind, pages left in place
        from sglang.srt.placement.libnuma import LibNuma

        LibNuma.move_private_pages = lambda self, policy, nodes: None
    outcome = numa_utils.bind_scheduler_process(server_args, args.node)
    placement = outcome.placement
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
                "strategy": placement.strategy,
                "reasons": placement.reasons,
                "threads_bound": outcome.threads,
                "torch_import_seconds": round(torch_seconds, 1),
                "resident_mib_before": sum(kb for _, kb in before.resident_kb) >> 10,
                "mappings_not_moved": outcome.mappings_not_moved,
                "shared_ratio_after_bind": _shared_ratio(target),
                "bind_seconds": round(bind_seconds, 3),
                "ratio_before": before.local_page_ratio(target),
                "ratio_after_bind": after_bind.local_page_ratio(target),
                "anon_ratio_after_bind": after_bind.local_page_ratio(
                    target, anon_only=True
                ),
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
