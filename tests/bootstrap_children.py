"""Scheduler ranks that run sglang's real CPU bootstrap, started from a JSON list of specs.

    python tests/bootstrap_children.py ranks|serve < SPECS.json

reads one JSON line (a list of rank specs), starts one process per spec and prints one
JSON line: every rank's report. Each rank publishes a real ``ServerArgs``
(``device="cpu"``, a tiny local model config, ``--dist-init-addr 127.0.0.1:<port>``)
as ``run_scheduler_process`` does, then calls bootstrap's ``init_parallel_runtime``,
upstream's whole path: thread binding, ``_init_cpu_threads_env`` (the kernel's
``initialize``), gloo ``torch.distributed`` and sglang's own ``GroupCoordinator``
groups. Stood in, because this host cannot have them: the CPU kernel's ops
(``bootstrap_standin_kernel``, or the built kernel a spec names), the AMX gate
(``bootstrap._is_cpu_amx_available`` and ``cpu_has_amx_support``, which
``is_shm_available`` reads: sglang 0.5.23 sets the shared memory up only on AMX or
arm64 hosts), and NCCL (the caller points ``SGLANG_NCCL_SO_PATH`` nowhere: this
torch is a CUDA build). Whichever sglang package is first on the path runs, so the
same driver serves the pristine and the overlaid one.

Once every rank of its engine is past ``init_parallel_runtime`` (a gloo barrier on
WORLD), a rank records what it maps of ``/dev/shm`` (``/proc/self/maps``: path, device
and inode), the variables sglang's code and C code see, its TP group, then sums
through ``GroupCoordinator.all_reduce`` and over WORLD. With ``ranks`` the ranks then
exit; with ``serve`` the driver prints the reports at once and the ranks stay until
stdin closes (or a test kills them), then exit normally.

Spec keys: ``engine``, ``tp_size``, ``pp_size``, ``tp_rank``, ``pp_rank``, ``port``
(the engine's ``--dist-init-addr`` port; bootstrap's dist port is ``port + 1``),
``value`` (this rank's addend); optional ``sums`` (false: no TP and WORLD sum),
``kernel`` (a built ``common_ops*.so`` to load
instead of the stand-in), ``allreduces`` with ``value_sum`` (that many checked sums
through the TP group), ``dist_timeout``, and ``at_initialize``: ``"report"`` makes the
rank report when it calls the kernel's ``initialize``, ``"pause"`` also makes it wait
there (to be killed) instead of calling it. With ``BOOTSTRAP_CHILDREN_STEPS=1`` each
rank writes ``step PID rank R: STEP`` lines to stderr as it goes (``_step``).

    python tests/bootstrap_children.py kernel < SPEC.json

is one rank on a built kernel without bootstrap: ``initialize.group`` with a spec's
``group`` (under the namespace bootstrap gives the engine on ``port``), else the
two-argument ``initialize`` from the environment, then ``allreduces`` checked sums
straight through ``shm_allreduce``; it prints one JSON line and exits once stdin
closes.
"""

from __future__ import annotations

import collections
import ctypes
import json
import logging
import multiprocessing
import os
import queue as queue_module
import signal
import sys
import time
import traceback
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import bootstrap_standin_kernel as kernel  # noqa: E402

TINY_MODEL = os.path.join(HERE, "data", "tiny_llama")
WATCHED = kernel.WATCHED
# Imported once by the fork server, so that each rank starts in moments.
_PRELOAD = [
    "bootstrap_children",
    "sglang.srt.server_args",
    "sglang.srt.distributed.bootstrap",
    "sglang.srt.distributed.parallel_state",
    "sglang.srt.runtime_context",
    "sglang.srt.arg_groups.pipeline",  # what publish imports: the model configs
]
_PR_SET_PDEATHSIG = 1
_SHM_MARKS = (
    "/dev/shm/deepspeed_allreduce_buffer_",
    "/dev/shm/sglang_ar_",
    "/dev/shm/#",
)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def environ_seen() -> dict[str, dict[str, Any]]:
    """``WATCHED`` as Python's ``os.environ`` and as C's ``getenv`` see them."""
    return {
        "py": {name: os.environ.get(name) for name in WATCHED},
        "c": {name: kernel.c_getenv(name) for name in WATCHED},
    }


def shm_files() -> list[dict[str, Any]]:
    """The collective's /dev/shm segments this process maps, each once: its path
    without the " (deleted)" the kernel appends once the name is gone ("/dev/shm/#N"
    for one made with O_TMPFILE), device, inode, and whether it was deleted."""
    seen = {}
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            if len(fields) < 6 or not fields[5].startswith(_SHM_MARKS):
                continue
            path = fields[5].rstrip("\n")
            deleted = path.endswith(" (deleted)")
            path = path.removesuffix(" (deleted)")
            seen[(fields[3], int(fields[4]))] = {
                "path": path,
                "dev": fields[3],
                "inode": int(fields[4]),
                "deleted": deleted,
            }
    return sorted(seen.values(), key=lambda m: (m["path"], m["inode"]))


def shm_maps() -> list[str]:
    """The same segments as /proc/self/maps names them (" (deleted)" and all)."""
    return sorted(
        {f["path"] + (" (deleted)" if f["deleted"] else "") for f in shm_files()}
    )


def _step(key: dict, name: str) -> None:
    """With ``BOOTSTRAP_CHILDREN_STEPS=1``, tell stderr this rank reached step ``name``
    (``start``, ``initialised``: past the kernel's initialize, ``unlinked``: past
    bootstrap's unlink, ``served``: its sums done), so that whoever kills it knows
    where it was."""
    if os.environ.get("BOOTSTRAP_CHILDREN_STEPS") == "1":
        print(f"step {os.getpid()} rank {key['tp_rank']}: {name}", file=sys.stderr,
              flush=True)  # fmt: skip


def _watch_initialize(key: dict, queue, *, at: Any) -> None:
    """Wrap ``sgl_kernel::initialize`` (and its ``group`` overload, where the kernel has
    one): with ``at="report"`` the rank reports when it calls it, with ``at="pause"``
    it then waits there (to be killed) instead. Everything else (``default``,
    ``overloads()``, which bootstrap asks) is the op's own."""
    import torch

    real = torch.ops.sgl_kernel.initialize

    def watched(call: Any, *args: Any) -> Any:
        if at:
            queue.put({**key, "pid": os.getpid(), "at_initialize": time.monotonic()})
        while at == "pause":
            time.sleep(1)
        result = call(*args)
        _step(key, "initialised")
        return result

    class Watched:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def __call__(self, *args: Any) -> Any:
            return watched(real, *args)

    if "group" in real.overloads():
        Watched.group = staticmethod(lambda *args: watched(real.group, *args))
    torch.ops.sgl_kernel.initialize = Watched()


def _watch_unlink(bootstrap: Any, key: dict) -> None:
    unlink = getattr(bootstrap, "_unlink_shm_segment", None)
    if unlink is None:  # pristine sglang unlinks nothing
        return

    def watched(path: str) -> None:
        unlink(path)
        _step(key, "unlinked")

    bootstrap._unlink_shm_segment = watched


def checked_all_reduces(all_reduce: Callable, spec: dict) -> dict:
    """``spec["allreduces"]`` sums, each compared with the expected one: fp32 and bf16
    in turn, every tenth of 1 Mi elements (a real kernel's large-message path) unless
    the stand-in runs, the others of 1 Ki; small integers, exact in bf16."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.counts[str(func)] += 1
            return func(*args, **(kwargs or {}))

    ops, wrong = Ops(), []
    large = 1 << 20 if spec.get("kernel") else 1024
    for i in range(spec.get("allreduces", 0)):
        dtype = (torch.float32, torch.bfloat16)[i % 2]
        base = torch.arange(large if i % 10 == 0 else 1024) % 5
        data = ((base + spec["value"]) * (i % 7 + 1)).to(dtype)
        with ops:
            result = all_reduce(data)
        result = data if result is None else result
        expected = (base * spec["tp_size"] + spec["value_sum"]) * (i % 7 + 1)
        if not torch.equal(result.to(torch.int64), expected):
            wrong.append(i)
    return {"count": spec.get("allreduces", 0), "wrong": wrong, "ops": ops.counts}


def _die_with_the_fork_server() -> None:
    """SIGKILL this rank when its parent, the fork server, exits: it does when the
    driver does, so that a driver killed on a timeout leaves no rank behind."""
    parent = os.getppid()
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it exited before the call
        os.kill(os.getpid(), signal.SIGKILL)


def rank_main(spec: dict, queue, stay) -> None:
    """One scheduler rank: bootstrap's real CPU path, then its report; with ``stay``
    (serve: the read end of a pipe) it stays until the driver closes the other end,
    or dies. (A shared event would not do: a killed rank that waits on it blocks the
    event's ``set`` for ever.)"""
    key = {k: spec[k] for k in ("engine", "pp_rank", "tp_rank")}
    _die_with_the_fork_server()
    _step(key, "start")
    try:
        environ_before = environ_seen()
        logs = _Lines()
        logging.getLogger("sglang.srt.distributed").addHandler(logs)
        logging.getLogger("sglang.srt.distributed").setLevel(logging.INFO)
        import torch

        if spec.get("kernel"):
            torch.ops.load_library(spec["kernel"])
        else:
            kernel.register()
        import torch.distributed as dist

        import sglang.srt.utils.common as common
        from sglang.srt.distributed import bootstrap
        from sglang.srt.distributed.parallel_state import get_tp_group
        from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank
        from sglang.srt.server_args import ServerArgs

        # The AMX gate: bootstrap's flag, and the one is_shm_available reads.
        bootstrap._is_cpu_amx_available = True
        common.cpu_has_amx_support = lambda: True
        _watch_initialize(key, queue, at=spec.get("at_initialize"))
        _watch_unlink(bootstrap, key)

        tp_size, pp_size = spec["tp_size"], spec["pp_size"]
        tp_rank, pp_rank = spec["tp_rank"], spec["pp_rank"]
        server_args = ServerArgs(
            model_path=TINY_MODEL,
            device="cpu",
            tp_size=tp_size,
            pp_size=pp_size,
            dist_init_addr=f"127.0.0.1:{spec['port']}",
            dist_timeout=spec.get("dist_timeout"),
        )
        # As run_scheduler_process does; the engine's gpu_id, base 0 and step 1.
        world_rank = spawn_world_rank(server_args, tp_rank=tp_rank, pp_rank=pp_rank)
        publish(
            server_args,
            role="scheduler",
            ranks=SpawnRanks(world_rank=world_rank, gpu_id=pp_rank * tp_size + tp_rank),
        )
        bootstrap.init_parallel_runtime(
            server_args=server_args, device="cpu", dist_port=spec["port"] + 1
        )
        environ_after = environ_seen()
        segment = next(
            (c.get("segment") for c in kernel.CALLS if c["op"] == "initialize"), None
        )
        named_after_init = bool(segment) and os.path.exists(segment)
        dist.barrier()  # every rank of the engine is past init_parallel_runtime
        files, maps = shm_files(), shm_maps()

        group = get_tp_group()
        tp_sum = world_sum = None
        if spec.get("sums", True):
            value = float(spec["value"])
            tp_tensor = torch.tensor([value, 2 * value], dtype=torch.bfloat16)
            group.all_reduce(tp_tensor)
            world_tensor = torch.tensor([value])
            dist.all_reduce(world_tensor)  # WORLD, over gloo
            tp_sum, world_sum = tp_tensor.tolist(), world_tensor.item()
        all_reduces = checked_all_reduces(group.all_reduce, spec)
        _step(key, "served")
        calls = [dict(c) for c in kernel.CALLS]
        report = {
            **key,
            "value": spec["value"],
            "pid": os.getpid(),
            "package": os.path.dirname(os.path.dirname(bootstrap.__file__)),
            "calls": calls,
            "segment": segment,
            # Its own name, as init_parallel_runtime returned (peers unlink theirs
            # after the same TP barrier, so theirs may still be there then).
            "named_after_init": named_after_init,
            "shm_maps": maps,
            "shm_files": files,
            "environ_before": environ_before,
            "environ_after": environ_after,
            "group": {
                "world_size": group.world_size,
                "local_size": group.local_size,
                "ranks": list(group.ranks),
            },
            "shm_available": common.is_shm_available(
                torch.bfloat16, group.world_size, group.local_size
            ),
            "tp_sum": tp_sum,
            "world_sum": world_sum,
            "all_reduces": all_reduces,
            "affinity": sorted(os.sched_getaffinity(0)),
            "cpu_s": sum(os.times()[:2]),
            "logs": logs.lines,
        }
        queue.put(report)
    except BaseException:
        queue.put({**key, "error": traceback.format_exc(), "at": time.monotonic()})
        return
    if stay is not None:
        try:
            stay.recv()  # the driver sends nothing: it closes its end to end this
        except EOFError:
            pass
    dist.barrier()  # no rank leaves while a peer may still read its segment


def run_ranks(
    specs: list[dict], *, timeout_s: float = 300.0, serve: bool = False
) -> list[dict]:
    """One process per spec; their reports. Every process is reaped before this
    returns (with ``serve``, once the reports are printed and stdin is closed)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    queue = context.Queue()
    pipes = [context.Pipe(duplex=False) if serve else (None, None) for _ in specs]
    processes = [
        context.Process(target=rank_main, args=(s, queue, stay))
        for s, (stay, _) in zip(specs, pipes)
    ]
    for process in processes:
        process.start()
    for stay, _ in pipes:
        if stay is not None:
            stay.close()  # the rank holds its own copy
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
        for _, release in pipes:
            if release is not None:
                release.close()
        complete = len(reports) == len(processes) and not any(
            "error" in r for r in reports
        )
        for process in processes:
            process.join(timeout=60 if complete else 1)
            if process.is_alive():
                process.kill()
                process.join()
    return reports


def kernel_rank(spec: dict) -> dict:
    """One rank on a built kernel, without bootstrap: with a ``"group"`` (and
    ``"port"``, ``"timeout"``), ``initialize.group`` under the namespace bootstrap
    gives the engine on that port; else the two-argument ``initialize`` from the
    environment. Then its checked sums straight through ``shm_allreduce``."""
    import torch

    torch.ops.load_library(spec["kernel"])
    started = time.monotonic()
    report: dict = {"rank": spec["tp_rank"]}
    try:
        if "group" in spec:
            namespace = f"sglang_ar_{os.getuid()}_127.0.0.1_{spec['port']}"
            torch.ops.sgl_kernel.initialize.group(
                spec["tp_size"],
                spec["tp_rank"],
                namespace,
                spec["group"],
                float(spec["timeout"]),
            )
        else:
            torch.ops.sgl_kernel.initialize(spec["tp_size"], spec["tp_rank"])
    except RuntimeError as exc:
        report["error"] = str(exc)
    report["wall_s"] = time.monotonic() - started
    report["shm_maps"] = shm_maps()
    if "error" not in report:
        op = torch.ops.sgl_kernel.shm_allreduce
        sum_op = int(torch.distributed.ReduceOp.SUM)
        report["all_reduces"] = checked_all_reduces(lambda d: op(d, sum_op), spec)
    return report


def _main(argv: list[str]) -> None:
    command = argv[1] if len(argv) > 1 else ""
    if command == "kernel":
        print(json.dumps(kernel_rank(json.loads(sys.stdin.readline()))), flush=True)
        sys.stdin.read()  # the mappings stay until the test is done with its peers
    elif command in ("ranks", "serve"):
        # By name, not as __main__, so that the fork server's children find it.
        import bootstrap_children

        specs = json.loads(sys.stdin.readline())
        reports = bootstrap_children.run_ranks(specs, serve=command == "serve")
        if command == "ranks":
            print(json.dumps(reports), flush=True)
    else:
        raise SystemExit(f"usage: {argv[0]} ranks|serve|kernel < JSON")


if __name__ == "__main__":
    _main(sys.argv)
