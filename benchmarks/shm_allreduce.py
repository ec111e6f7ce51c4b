"""Time of one ``sgl_kernel::shm_allreduce`` on the built CPU kernel, two ranks.

    SGLANG_CPU_KERNEL=/path/to/common_ops.so .venv/bin/python benchmarks/shm_allreduce.py \
        [--iterations 2000] [--repeats 5]

Two forked ranks, each pinned to a CPU of its own, join one group (a kernel with
``initialize.group``) or set up the two-argument way (the released kernel),
then sum bf16 tensors of 4 KiB (the small-message path), 64 KiB, 1 MiB and 16 MiB
(the large-message path). For each size it prints the best and the median, over the
repeats, of the mean time per all-reduce, in microseconds, as rank 0 saw it (on a busy
host, the best is the one to compare).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import secrets
import statistics
import time

SIZES = {"4 KiB": 2 << 10, "64 KiB": 32 << 10, "1 MiB": 512 << 10, "16 MiB": 8 << 20}


def rank_main(rank: int, args: argparse.Namespace, results) -> None:
    import torch

    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    torch.set_num_threads(1)
    torch.ops.load_library(os.environ["SGLANG_CPU_KERNEL"])
    op = torch.ops.sgl_kernel.initialize
    if "group" in op.overloads():  # a kernel with upstream_prs' initialize.group
        op.group(2, rank, f"sglang_ar_bench_{os.getppid()}", args.group, 60.0)
    else:
        os.environ.update(LOCAL_SIZE="2", MASTER_ADDR="bench", MASTER_PORT=args.group)
        op(2, rank)
    reduce = torch.ops.sgl_kernel.shm_allreduce
    found = {}
    for name, numel in SIZES.items():
        data = torch.ones(numel, dtype=torch.bfloat16)
        iterations = max(10, args.iterations * (2 << 10) // numel)
        means = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            for _ in range(iterations):
                reduce(data, 0)  # ReduceOp.SUM
                data.fill_(1)
            means.append((time.perf_counter() - started) / iterations * 1e6)
        found[name] = (min(means), statistics.median(means))
    results.put((rank, found))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    args.group = secrets.token_hex(8)
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    ranks = [context.Process(target=rank_main, args=(r, args, results)) for r in (0, 1)]
    for process in ranks:
        process.start()
    found = dict(results.get(timeout=600) for _ in ranks)
    for process in ranks:
        process.join(timeout=60)
    print(f"kernel {os.environ['SGLANG_CPU_KERNEL']}")
    for name in SIZES:
        best, median = found[0][name]
        print(f"{name:>7}: best {best:9.1f} us, median {median:9.1f} us per all-reduce")
    released = [f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_bench_{args.group}_{r}"
                for r in (0, 1)]  # fmt: skip
    for path in released:  # the released kernel never unlinks its segments
        if os.path.exists(path):
            os.unlink(path)


if __name__ == "__main__":
    main()
