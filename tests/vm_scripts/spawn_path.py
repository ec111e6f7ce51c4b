"""Inside a multi-NUMA VM: ranks spawned the way sglang spawns them, each reading its binding back.

Every rank is a spawn-context child started as ``with
numa_utils.configure_subprocess(server_args, gpu_id): proc.start()``; it
touches ``--touch-mb`` of memory and reports its CPUs, memory policy and where
its anonymous pages are. Beside each report is what ``plan --json`` says for
that rank (the same process's ``plan_engine``). Plain Python only: under
emulation every import is slow, so ``sglang.srt.utils`` (whose ``__init__``
imports torch) is loaded as a bare package, like ``sglang`` itself.

    python tests/vm_scripts/spawn_path.py cpu-engines
    python tests/vm_scripts/spawn_path.py gpu-reindex      # tp=2 x dp=2, one visible GPU per spawn
    python tests/vm_scripts/spawn_path.py locality --device cuda|cpu --start-cpu 0

Prints one JSON object on its last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import types
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, os.pardir, "harness"), os.path.join(HERE, os.pardir)]
import sglang_light  # noqa: E402

sglang_light.bare_package("sglang.srt.utils")

from spawn_support import (  # noqa: E402  (the ServerArgs fields placement reads)
    args as engine,
)


def rank_report(queue, touch_mb: int) -> None:
    """A spawned rank (top level, so the child can import it): touch memory, then report its binding."""
    from sglang.srt.placement_tools.verify import observe_self

    block = bytearray(touch_mb << 20)
    for offset in range(0, len(block), 4096):
        block[offset] = 1
    queue.put(observe_self().to_dict())


def spawn(server_args, gpu_id: int, *, touch_mb: int) -> dict:
    import multiprocessing

    from sglang.srt.utils import numa_utils

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=rank_report, args=(queue, touch_mb))
    with numa_utils.configure_subprocess(server_args, gpu_id):
        proc.start()
    try:
        return queue.get(timeout=240)
    finally:
        proc.join(60)


def run_engine(
    server_args, *, touch_mb: int, reindex: bool = False, only: Optional[int] = None
) -> list[dict]:
    """Every local rank of ``server_args`` (or the one of GPU id ``only``), planned then spawned as sglang
    does; one row per rank."""
    from sglang.srt.placement_tools.engine import local_ranks, reindexed

    plan = plan_json(server_args)
    rows = []
    for rank, placement in zip(local_ranks(server_args), plan):
        index = rank.device.index
        if only is not None and index != only:
            continue
        gpu_id, saved = index, os.environ.get("CUDA_VISIBLE_DEVICES")
        if reindex:
            # What upstream's maybe_reindex_device_id does around the spawn: one visible GPU, as GPU 0.
            gpu_id, narrowed = reindexed(index, os.environ)
            os.environ["CUDA_VISIBLE_DEVICES"] = narrowed["CUDA_VISIBLE_DEVICES"]
        try:
            observed = spawn(server_args, gpu_id, touch_mb=touch_mb)
        finally:
            if reindex:
                if saved is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = saved
        rows.append(
            {
                "rank": rank.label,
                "gpu_id": index,
                "spawned_gpu_id": gpu_id,
                "plan": placement,
                "observed": observed,
            }
        )
    return rows


def plan_json(server_args) -> list[dict]:
    """What ``python -m sglang.srt.placement_tools plan --json`` prints for ``server_args`` here."""
    import subprocess

    flags = [
        "--device",
        server_args.device,
        "--tp-size",
        str(server_args.tp_size),
        "--dp-size",
        str(server_args.dp_size),
        "--base-gpu-id",
        str(server_args.base_gpu_id),
    ]
    done = subprocess.run(
        [sys.executable, "-m", "sglang.srt.placement_tools", "plan", "--json", *flags],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)["ranks"]


def use_fake_gpu_tree() -> None:
    """This VM's real nodes and CPUs, with two NVIDIA GPUs on each node (only the PCI entries are fake), as
    this process's and its children's host, a CUDA one (the test harness's variables).
    """
    os.environ["PLACEMENT_TESTS_SYSFS"] = fake_gpu_tree()
    os.environ["PLACEMENT_TESTS_PLATFORM"] = "cuda"
    sglang_light.fake_host_from_environment()
    if "sglang.srt.utils.numa_utils" in sys.modules:
        sys.modules["sglang.srt.utils.numa_utils"]._is_cuda = True


def fake_gpu_tree() -> str:
    """This VM's real nodes and CPUs, with two NVIDIA GPUs on each node."""
    from spawn_support import fake_host

    from sglang.srt.placement.topology import read_topology

    live = read_topology("/sys")
    root = tempfile.mkdtemp(prefix="gpu-sysfs-")
    fake_host(
        os.path.join(root, "sys"),
        node_cpus={n.node_id: set(n.cpus) for n in live.cpu_nodes},
    )
    return os.path.join(root, "sys")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=("cpu-engines", "gpu-reindex", "locality"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--touch-mb", type=int, default=16)
    parser.add_argument("--start-cpu", type=int, default=None)
    args = parser.parse_args()
    if args.start_cpu is not None:
        # The launcher runs on this CPU's node: an unbound start would put the rank's first pages there.
        os.sched_setaffinity(0, {args.start_cpu})
    out: dict = {"parent_cpus": sorted(os.sched_getaffinity(0))}
    if args.scenario == "cpu-engines":
        os.environ.pop("SGLANG_CPU_OMP_THREADS_BIND", None)
        out["tp2"] = run_engine(engine(device="cpu", tp_size=2), touch_mb=args.touch_mb)
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "0-1|2-3"
        out["router"] = [
            row
            for base in (0, 1)
            for row in run_engine(
                engine(device="cpu", base_gpu_id=base), touch_mb=args.touch_mb
            )
        ]
    elif args.scenario == "gpu-reindex":
        use_fake_gpu_tree()
        os.environ["SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS"] = "1"
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        out["rows"] = run_engine(
            engine(tp_size=2, dp_size=2), touch_mb=args.touch_mb, reindex=True
        )
    else:
        if args.device == "cuda":
            use_fake_gpu_tree()
            server_args = engine(tp_size=4)  # GPU 2 is on node 1
            gpu_id = 2
        else:
            os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "0-1|2-3"
            server_args = engine(device="cpu", tp_size=2)
            gpu_id = 1  # the rank on node 1
        (out["row"],) = run_engine(server_args, touch_mb=args.touch_mb, only=gpu_id)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
