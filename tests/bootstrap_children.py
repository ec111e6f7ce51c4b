"""Scheduler ranks that run bootstrap's real CPU path, and a segment holder.

``python bootstrap_children.py ranks`` reads a JSON list of rank specs on stdin,
starts one process per rank and prints one JSON line: each rank's report. A rank
publishes a real ``ServerArgs`` (``device="cpu"``, a tiny local model config) as
``run_scheduler_process`` does, then calls bootstrap's ``init_parallel_runtime``,
the whole of upstream's path: thread binding, ``_init_cpu_threads_env``, gloo
``torch.distributed`` and sglang's own ``GroupCoordinator`` groups. Stood in,
because this host cannot have them: the CPU kernel's ops (``shm_kernel_standin``),
the AMX flag, and NCCL's absence (this torch is a CUDA build; a CPU build has no
NCCL, so ``SGLANG_NCCL_SO_PATH`` points nowhere). Whichever sglang package is first
on the path runs, so the same driver serves the pristine and the overlaid one.

``python bootstrap_children.py serve`` does the same, but prints the reports as soon
as every rank has sent one and keeps the ranks alive (for a test to kill them) until
stdin closes; a spec with ``"pause_before_groups": true`` reports instead when its
rank is past ``initialize`` and about to build its groups, and waits there;
``"at_initialize": "report"`` reports when the rank calls ``sgl_kernel::initialize``,
``"pause"`` also waits there instead of calling it.

``python bootstrap_children.py hold SCHEMA ADDR PORT TP_SIZE TP_RANK`` initialises one
rank with ``init_shm_collective`` and holds its segment until stdin closes.

A spec with ``"kernel": PATH`` loads that built CPU kernel instead of the stand-in,
and ``"allreduces": N`` runs N checked sums through the TP group after the rest, and
``"tcp_store_port": P`` then creates parallel_state's global TCPStore on port P.
``python bootstrap_children.py kernel < SPEC.json`` is one rank on a built kernel
without bootstrap: ``initialize`` (through ``init_shm_collective`` when the spec has
a ``"port"``, else the two-argument op from the environment), then its all-reduces
straight through ``shm_allreduce``; it prints one JSON line.
"""

from __future__ import annotations

import collections
import json
import logging
import multiprocessing
import os
import queue as queue_module
import stat
import sys
import threading
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import shm_kernel_standin as kernel  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

TINY_MODEL = os.path.join(HERE, "data", "tiny_llama")
WATCHED = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE")
# Imported once by the fork server, so that each rank starts in moments.
_PRELOAD = [
    "bootstrap_children",
    "sglang.srt.server_args",
    "sglang.srt.distributed.bootstrap",
    "sglang.srt.distributed.parallel_state",
]


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def _capture_logs() -> _ListHandler:
    """The package's log lines, kept for the report; with ``BOOTSTRAP_CHILDREN_STEPS=1``
    also written to stderr at once, so that whoever kills the rank knows its step."""
    handler = _ListHandler()
    logger = logging.getLogger("sglang.srt.distributed")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    if os.environ.get("BOOTSTRAP_CHILDREN_STEPS") == "1":
        steps = logging.StreamHandler(sys.stderr)
        steps.setLevel(logging.INFO)
        steps.setFormatter(logging.Formatter("step %(process)d %(message)s"))
        logger.addHandler(steps)
    return handler


def _c_environ() -> dict[str, Any]:
    return {name: kernel.c_getenv(name) for name in WATCHED}


def _py_environ() -> dict[str, Any]:
    return {name: os.environ.get(name) for name in WATCHED}


def _pause_before_groups(bootstrap, key: dict, queue) -> None:
    """Make the rank report, then wait to be killed, where bootstrap starts building
    its groups (every rank of the engine past ``initialize``, nothing unlinked)."""

    def paused(**_kwargs) -> None:
        queue.put({**key, "pid": os.getpid(), "paused": True})
        while True:
            time.sleep(1)

    bootstrap.init_distributed_environment = paused


def _at_initialize(key: dict, queue, *, pause: bool) -> None:
    """Make the rank report when it calls ``sgl_kernel::initialize``; with ``pause``
    it then waits there to be killed, instead of calling it."""
    import torch

    real = torch.ops.sgl_kernel.initialize

    class Reporting:
        default = real.default  # its schema, for the caller

        def __call__(self, *args):
            queue.put({**key, "pid": os.getpid(), "at_initialize": time.monotonic()})
            while pause:
                time.sleep(1)
            return real(*args)

    torch.ops.sgl_kernel.initialize = Reporting()


def rank_main(spec: dict, queue, linger: bool = False) -> None:
    """One scheduler rank: bootstrap's real path, then a TP and a WORLD all-reduce."""
    key = {k: spec[k] for k in ("engine", "pp_rank", "tp_rank")}
    try:
        environ_before = dict(os.environ)
        logs = _capture_logs()
        step = logging.getLogger("sglang.srt.distributed.steps").info
        step(f"rank {spec['tp_rank']}: start")
        import torch

        if spec.get("kernel"):
            torch.ops.load_library(spec["kernel"])
        else:
            kernel.register(spec["schema"], threads_env=True, all_reduce=True)
        import torch.distributed as dist

        import sglang.srt.utils.common as common
        from sglang.srt.distributed import bootstrap
        from sglang.srt.distributed.parallel_state import get_tp_group
        from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank
        from sglang.srt.server_args import ServerArgs

        # This host has no AMX: bootstrap's flag and the one is_shm_available reads.
        bootstrap._is_cpu_amx_available = True
        common.cpu_has_amx_support = lambda: True
        if spec.get("pause_before_groups"):
            _pause_before_groups(bootstrap, key, queue)
        if spec.get("at_initialize"):
            _at_initialize(key, queue, pause=spec["at_initialize"] == "pause")

        tp_size, pp_size = spec["tp_size"], spec["pp_size"]
        tp_rank, pp_rank = spec["tp_rank"], spec["pp_rank"]
        server_args = ServerArgs(
            model_path=TINY_MODEL,
            device="cpu",
            tp_size=tp_size,
            pp_size=pp_size,
            dist_init_addr=f"127.0.0.1:{spec['port']}",
            disable_custom_all_reduce=True,
            dist_timeout=spec.get("dist_timeout"),
        )
        # As run_scheduler_process does; the gpu_id is the engine's, with base 0, step 1.
        world_rank = spawn_world_rank(server_args, tp_rank=tp_rank, pp_rank=pp_rank)
        publish(
            server_args,
            role="scheduler",
            ranks=SpawnRanks(world_rank=world_rank, gpu_id=pp_rank * tp_size + tp_rank),
        )
        bootstrap.init_parallel_runtime(
            server_args=server_args, device="cpu", dist_port=spec["port"] + 1
        )
        after = {"py": _py_environ(), "c": _c_environ()}

        group = get_tp_group()
        shm_available = common.is_shm_available(
            torch.bfloat16, group.world_size, group.local_size
        )
        value = float(spec["value"])
        tp_tensor = torch.tensor([value, 2 * value], dtype=torch.bfloat16)
        group.all_reduce(tp_tensor)
        world_tensor = torch.tensor([value])
        dist.all_reduce(world_tensor)  # WORLD, over gloo

        sums = checked_all_reduces(group.all_reduce, spec)
        if spec.get("tcp_store_port"):
            _global_tcp_store(spec)
        step(f"rank {spec['tp_rank']}: served")
        calls = [dict(c) for c in kernel.CALLS]
        initialize = [c for c in calls if c["op"] == "initialize"]
        segment = initialize[0]["segment"] if initialize else None
        path = os.path.join(kernel.SHM_DIR, segment) if segment else None
        report = {
            **key,
            "pid": os.getpid(),
            "package": os.path.dirname(os.path.dirname(bootstrap.__file__)),
            "calls": calls,
            "segment": segment,
            "segment_mode": (
                stat.S_IMODE(os.stat(path).st_mode)
                if path and os.path.exists(path)
                else None
            ),
            # bootstrap unlinked the name once the groups were built.
            "segment_exists": bool(path and os.path.exists(path)),
            "peer_prefixes": {str(r): p for r, p in kernel.peer_prefixes().items()},
            "environ_before": {n: environ_before.get(n) for n in WATCHED},
            "environ_after": after,
            # Names, besides WATCHED, that the rank's start-up set or changed.
            "environ_changed": sorted(
                k
                for k in set(os.environ) | set(environ_before)
                if k not in WATCHED and os.environ.get(k) != environ_before.get(k)
            ),
            "group": {
                "world_size": group.world_size,
                "local_size": group.local_size,
                "ranks": list(group.ranks),
            },
            "shm_available": shm_available,
            "tp_sum": tp_tensor.tolist(),
            "world_sum": world_tensor.item(),
            "all_reduces": sums,
            "shm_maps": shm_maps(),
            # What parallel_state's global TCPStore read of MASTER_ADDR, and made.
            "tcp_store": [
                x for x in logs.lines if "TCPStore at" in x or "master IP" in x
            ],
            "affinity": sorted(os.sched_getaffinity(0)),
            "num_threads": torch.get_num_threads(),
        }
        report["logs"] = logs.lines
        queue.put(report)
    except BaseException:
        queue.put({**key, "error": traceback.format_exc(), "at": time.monotonic()})
        return
    dist.barrier()  # no rank leaves while a peer still reads its segment
    while linger:
        time.sleep(1)


class _OpCounter(TorchDispatchMode):
    """Counts the ops dispatched while it is active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _global_tcp_store(spec: dict) -> None:
    """sglang's one reader of MASTER_ADDR: the global TCPStore that
    ``init_distributed_environment`` creates on every rank under ``--moe-a2a-backend
    nixl``, here on the port the spec names."""
    import torch.distributed as dist

    from sglang.srt.distributed import parallel_state
    from sglang.srt.environ import envs

    with envs.SGLANG_TCP_STORE_PORT.override(spec["tcp_store_port"]):
        parallel_state._create_global_tcp_store(
            dist.get_rank(),
            dist.get_world_size(),
            dist_init_addr=f"tcp://127.0.0.1:{spec['port'] + 1}",
        )


def checked_all_reduces(all_reduce, spec: dict) -> dict:
    """``spec["allreduces"]`` sums, each compared with the expected one: fp32 and bf16
    in turn, every tenth of 1 Mi elements (the kernel's large-message path), the others
    of 4 Ki; values are small integers, exact in bf16."""
    import torch

    counter, wrong = _OpCounter(), []
    for i in range(spec.get("allreduces", 0)):
        dtype = (torch.float32, torch.bfloat16)[i % 2]
        base = torch.arange((1 << 20) if i % 10 == 0 else 4096) % 5
        data = ((base + spec["value"]) * (i % 7 + 1)).to(dtype)
        with counter:
            result = all_reduce(data)
        result = data if result is None else result
        expected = (base * spec["tp_size"] + spec["value_sum"]) * (i % 7 + 1)
        if not torch.equal(result.to(torch.int64), expected):
            wrong.append(i)
    return {"count": spec.get("allreduces", 0), "wrong": wrong, "ops": counter.counts}


def shm_maps() -> list[str]:
    """The collective's /dev/shm segments this process maps, as /proc/self/maps
    names them: the released kernel's names, those of a kernel with groups, and "#<inode>"
    for a segment its owner made with O_TMPFILE."""
    marks = (
        "/dev/shm/deepspeed_allreduce_buffer_",
        "/dev/shm/sglang_ar_",
        "/dev/shm/#",
    )
    with open("/proc/self/maps") as maps:
        rows = [line.split(None, 5) for line in maps]
    return sorted(
        {r[5].strip() for r in rows if len(r) == 6 and r[5].startswith(marks)}
    )


def kernel_rank(spec: dict) -> dict:
    """One rank on a built kernel, without bootstrap; its report (or error). With a
    ``"group"``, ``join_shm_group`` on the spec's port; else the two-argument op."""
    import resource

    import torch

    from sglang.srt.distributed.shm_collective import ShmNamespace, join_shm_group

    torch.ops.load_library(spec["kernel"])
    started, used = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
    report: dict = {"rank": spec["tp_rank"]}
    try:
        if "group" in spec:
            join_shm_group(
                ShmNamespace(addr="127.0.0.1", port=spec["port"]),
                tp_size=spec["tp_size"],
                tp_rank=spec["tp_rank"],
                group=spec["group"],
                timeout=spec["timeout"],
            )
        else:
            torch.ops.sgl_kernel.initialize(spec["tp_size"], spec["tp_rank"])
    except RuntimeError as exc:
        report["error"] = str(exc)
    now = resource.getrusage(resource.RUSAGE_SELF)
    report["wall_s"] = time.monotonic() - started
    report["cpu_s"] = now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime
    report["shm_maps"] = shm_maps()
    if "error" not in report:
        op = torch.ops.sgl_kernel.shm_allreduce
        reduce = lambda data: op(data, int(torch.distributed.ReduceOp.SUM))  # noqa
        report["all_reduces"] = checked_all_reduces(reduce, spec)
    return report


def run_ranks(
    specs: list[dict], *, timeout_s: float = 300.0, serve: bool = False
) -> list[dict]:
    """Start one process per spec, return their reports; every process is reaped
    (with ``serve``, once the reports are printed and stdin is closed)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    queue = context.Queue()
    processes = [
        context.Process(target=rank_main, args=(s, queue, serve)) for s in specs
    ]
    for process in processes:
        process.start()
    reports: list[dict] = []
    try:
        deadline = time.monotonic() + timeout_s
        while len(reports) < len(processes) and not any("error" in r for r in reports):
            try:
                reports.append(queue.get(timeout=1))
            except queue_module.Empty:
                # A killed rank never reports: stop waiting for the others.
                killed = any(p.exitcode not in (None, 0) for p in processes)
                if killed or time.monotonic() > deadline:
                    break
        if serve:
            print(json.dumps(reports), flush=True)
            sys.stdin.read()
    finally:
        for process in processes:
            # Served ranks wait to be killed; others end on their own.
            done = len(reports) == len(processes) and not serve
            process.join(timeout=30 if done else 1)
            if process.is_alive():
                process.kill()
                process.join()
    return reports


def _hold(schema: str, addr: str, port: int, tp_size: int, tp_rank: int) -> None:
    """Initialise one rank and hold its segment until stdin closes (or a kill)."""
    from sglang.srt.distributed import shm_collective

    kernel.register(schema)
    namespace = shm_collective.ShmNamespace(addr=addr, port=port)
    if schema == "released":
        init, kwargs = shm_collective.init_shm_collective, {}
        segment = f"/dev/shm/{namespace.segment_name(tp_rank)}"
    else:
        init, kwargs = shm_collective.join_shm_group, {"group": "g", "timeout": 300.0}
        segment = f"/dev/shm/{namespace.group_namespace}_g_{tp_rank}"
    # With peers that never come, the kernel waits in initialize: run it aside.
    worker = threading.Thread(
        target=init,
        args=(namespace,),
        kwargs={"tp_size": tp_size, "tp_rank": tp_rank, **kwargs},
        daemon=True,
    )
    worker.start()
    while not os.path.exists(segment):
        worker.join(0.01)
        if not worker.is_alive() and not os.path.exists(segment):
            print("failed", flush=True)
            return
    print("ready", flush=True)
    sys.stdin.read()


def _main(argv: list[str]) -> None:
    if argv[1] == "hold":
        _hold(argv[2], argv[3], int(argv[4]), int(argv[5]), int(argv[6]))
    elif argv[1] == "kernel":
        report = kernel_rank(json.loads(sys.stdin.readline()))
        print(json.dumps(report), flush=True)
        sys.stdin.read()  # the mappings stay until the test is done with its peers
    elif argv[1] in ("ranks", "serve"):
        # By name, not as __main__, so that the fork server's children find it.
        import bootstrap_children

        specs = json.loads(sys.stdin.readline())
        reports = bootstrap_children.run_ranks(specs, serve=argv[1] == "serve")
        if argv[1] == "ranks":
            print(json.dumps(reports))
    else:
        raise SystemExit(f"usage: {argv[0]} ranks|serve < SPECS.json | hold ...")


if __name__ == "__main__":
    _main(sys.argv)
