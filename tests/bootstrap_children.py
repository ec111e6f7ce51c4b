"""Process bodies for the bootstrap tests: engine ranks (multiprocessing spawn targets)
and a segment holder run as a script (``python bootstrap_children.py hold ...``)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import shm_kernel_standin as kernel  # noqa: E402


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def _capture_logs() -> _ListHandler:
    handler = _ListHandler()
    logger = logging.getLogger("sglang.srt.distributed")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    return handler


def _thread_affinities() -> dict[int, list[int]]:
    result = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            result[int(tid)] = sorted(os.sched_getaffinity(int(tid)))
        except ProcessLookupError:
            continue
    return result


def engine_rank(
    engine: int, rank: int, port: int, schema: str, cpu: int, queue, tp_size: int = 2,
    world_size: int = 2,
) -> None:
    """One rank of one engine: bootstrap, a gloo allreduce, a shared-memory sum."""
    try:
        env_before = dict(os.environ)
        c_env_before = {n: kernel.c_getenv(n) for n in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE")}
        logs = _capture_logs()
        kernel.register(schema)
        import torch
        import torch.distributed as dist

        from sglang.srt.distributed.shm_collective import init_torch_distributed, release_shm_collective

        boot = init_torch_distributed(
            tp_size=tp_size,
            tp_rank=rank % tp_size,
            world_size=world_size,
            rank=rank,
            device="cpu",
            dist_init_addr=f"127.0.0.1:{port}",
            cpu_ids=str(cpu),
            numa_index=0,
            timeout=60,
        )
        value = float(rank + 1 + 10 * engine)
        tensor = torch.tensor([value])
        dist.all_reduce(tensor)
        shm_total = kernel.shm_sum(value, sequence=1, barrier=dist.barrier)
        segment = boot.namespace.segment_name(rank % tp_size)
        result = {
            "engine": engine,
            "rank": rank,
            "pid": os.getpid(),
            "calls": list(kernel.CALLS),
            "segment": segment,
            "segment_mode": os.stat(f"/dev/shm/{segment}").st_mode & 0o777,
            "peer_prefixes": kernel.peer_prefixes(),
            "prefix": boot.namespace.prefix,
            "shm_collective": boot.shm_collective,
            "bound_cpus": boot.bound_cpus,
            "affinities": _thread_affinities(),
            "num_threads": torch.get_num_threads(),
            "allreduce": tensor.item(),
            "shm_sum": shm_total,
            "env_same": dict(os.environ) == env_before,
            "c_env_same": c_env_before
            == {n: kernel.c_getenv(n) for n in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE")},
            "c_master_port": kernel.c_getenv("MASTER_PORT"),
        }
        dist.barrier()
        result["released"] = release_shm_collective()
        result["segment_after_release"] = os.path.exists(f"/dev/shm/{segment}")
        dist.destroy_process_group()
        result["logs"] = logs.lines
        queue.put(result)
    except BaseException:
        queue.put({"engine": engine, "rank": rank, "error": traceback.format_exc()})


def bind_threads(cpu_ids: str, with_op: bool, queue) -> None:
    """Start extra threads, bind, and report every thread's affinity."""
    try:
        logs = _capture_logs()
        if with_op:
            kernel.register("released", threads_env=True)
        import torch

        from sglang.srt.distributed.shm_collective import bind_rank_threads

        stop = threading.Event()
        workers = [threading.Thread(target=stop.wait) for _ in range(3)]
        for worker in workers:
            worker.start()
        applied = bind_rank_threads(cpu_ids, tp_rank=1, numa_index=0, world_size=2)
        late = threading.Thread(target=stop.wait)
        late.start()
        result = {
            "applied": applied,
            "affinities": _thread_affinities(),
            "late": sorted(os.sched_getaffinity(late.native_id)),
            "num_threads": torch.get_num_threads(),
            "calls": list(kernel.CALLS),
            "logs": logs.lines,
        }
        stop.set()
        for worker in [*workers, late]:
            worker.join()
        queue.put(result)
    except BaseException:
        queue.put({"error": traceback.format_exc()})


def _hold(schema: str, addr: str, port: int, tp_size: int, tp_rank: int) -> None:
    """Initialise one rank and hold its segment until stdin closes (or a kill)."""
    from sglang.srt.distributed.shm_collective import ShmNamespace, init_shm_collective

    kernel.register(schema)
    namespace = ShmNamespace(addr=addr, port=port)
    # With peers that never come, the kernel waits in initialize: run it aside.
    worker = threading.Thread(
        target=init_shm_collective,
        args=(namespace,),
        kwargs={"tp_size": tp_size, "tp_rank": tp_rank},
        daemon=True,
    )
    worker.start()
    segment = f"/dev/shm/{namespace.segment_name(tp_rank)}"
    while not os.path.exists(segment):
        worker.join(0.01)
        if not worker.is_alive() and not os.path.exists(segment):
            print("failed", flush=True)
            return
    print("ready", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    if sys.argv[1] == "hold":
        _hold(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
