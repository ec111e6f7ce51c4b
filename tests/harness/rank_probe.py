"""Scheduler ranks started as sglang starts them, each reporting the binding it got.

The launching side, ``launch``, starts every rank as sglang's Engine and data-parallel
controller do: a spawn-context ``Process`` whose ``start()`` runs inside
``numa_utils.configure_subprocess(server_args, gpu_id)``, the ranks of each dp rank
from a thread of their own when asked (the controller's way). A rank is one of:

* ``scheduler_rank``: sglang's own ``run_scheduler_process``, with only its
  ``Scheduler`` replaced by ``ProbeScheduler``, which loads no model. It is built
  where the real one is, after ``configure_scheduler_process``, reads this process's
  binding and sends it back over the pipe as the real one sends its init info.
* ``report_rank``: reports at once, for what is decided before the rank runs any
  sglang code (a rank started under numactl).

Every rank imports this module to unpickle its target, so it imports nothing heavy at
module level. ``observe`` reads only /proc and one system call.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import threading
import types
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

PROBE_MODEL = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "tiny_llama"
)
# get_mempolicy(2) by architecture; its modes by number (linux/mempolicy.h).
_GET_MEMPOLICY = {"x86_64": 239, "aarch64": 236}
_POLICIES = (
    "default",
    "preferred",
    "bind",
    "interleave",
    "local",
    "preferred_many",
    "weighted_interleave",
)
_MAX_NODES = 1024


def parse_cpulist(text: str) -> list[int]:
    """``[0, 1, 2, 8]`` for ``0-2,8``, as /proc and sysfs write lists."""
    ids: list[int] = []
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            ids.extend(range(int(first), int(last or first) + 1))
    return ids


def _status_field(path: str, name: str) -> str:
    with open(path) as f:
        for line in f:
            if line.startswith(f"{name}:"):
                return line.split(":", 1)[1].strip()
    raise LookupError(f"{path} has no {name}")


def memory_policy() -> tuple[str, list[int]]:
    """This thread's memory policy and its nodes, as get_mempolicy(2) reports them."""
    libc = ctypes.CDLL(None, use_errno=True)
    mode = ctypes.c_int()
    words = _MAX_NODES // (8 * ctypes.sizeof(ctypes.c_ulong))
    mask = (ctypes.c_ulong * words)()
    number = _GET_MEMPOLICY[os.uname().machine]
    if libc.syscall(number, ctypes.byref(mode), mask, _MAX_NODES, None, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"get_mempolicy: {os.strerror(error)}")
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    nodes = [n for n in range(_MAX_NODES) if mask[n // bits] >> (n % bits) & 1]
    policy = mode.value & 0xFF  # the mode flags (MPOL_F_*) sit above
    return (_POLICIES[policy] if policy < len(_POLICIES) else str(policy)), nodes


def pages_by_node() -> dict[str, dict[str, int]]:
    """kB of this process's resident anonymous memory, and of all of it, per node."""
    anon: dict[str, int] = {}
    every: dict[str, int] = {}
    with open("/proc/self/numa_maps") as f:
        for line in f:
            fields = line.split()[2:]
            page_kb = 4
            for field in fields:
                if field.startswith("kernelpagesize_kB="):
                    page_kb = int(field.split("=", 1)[1])
            is_file = any(field.startswith("file=") for field in fields)
            for field in fields:
                name, _, pages = field.partition("=")
                if name[:1] == "N" and name[1:].isdigit() and pages.isdigit():
                    kb = int(pages) * page_kb
                    every[name[1:]] = every.get(name[1:], 0) + kb
                    if not is_file:
                        anon[name[1:]] = anon.get(name[1:], 0) + kb
    return {"anon_kb": anon, "resident_kb": every}


def observe(*, touch_mb: int = 0) -> dict:
    """This process's binding as the kernel sees it: its CPUs, every thread's, the
    memory nodes it may use, its memory policy and title; with ``touch_mb``, where
    that many MiB touched now landed, with all its other pages."""
    block = bytearray(touch_mb << 20)
    for offset in range(0, len(block), 4096):
        block[offset] = 1
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            status = f"/proc/self/task/{tid}/status"
            threads[tid] = parse_cpulist(_status_field(status, "Cpus_allowed_list"))
        except (FileNotFoundError, ProcessLookupError):  # it exited meanwhile
            pass
    policy, policy_nodes = memory_policy()
    with open("/proc/self/cmdline", "rb") as f:
        title = f.read().split(b"\0")[0].decode(errors="replace")
    report = {
        "pid": os.getpid(),
        "title": title,
        "cpus": parse_cpulist(_status_field("/proc/self/status", "Cpus_allowed_list")),
        "thread_cpus": [list(c) for c in sorted({tuple(c) for c in threads.values()})],
        "threads": len(threads),
        "mems": parse_cpulist(_status_field("/proc/self/status", "Mems_allowed_list")),
        "policy": policy,
        "policy_nodes": policy_nodes,
    }
    if touch_mb:
        report.update(pages_by_node())
    del block
    return report


def report_rank(writer, touch_mb: int = 0) -> None:
    """A rank that reports at once (a spawn target)."""
    writer.send(observe(touch_mb=touch_mb))
    writer.close()


class ProbeScheduler:
    """Stands in for sglang's ``Scheduler``: built where it is (after
    ``configure_scheduler_process``), it observes this process and loads nothing.
    It never raises: ``run_scheduler_process`` would signal its parent."""

    def __init__(self, server_args=None, port_args=None, *args, **kwargs) -> None:
        self.async_d2h_worker = None
        self.gracefully_exit = False
        self.metrics_reporter = types.SimpleNamespace(_shutdown_fpm=lambda: None)
        try:
            self.info = observe()
        except Exception as e:  # reported, never raised
            self.info = {"error": f"{type(e).__name__}: {e}"}

    def get_init_info(self) -> dict:
        return self.info

    def run_event_loop(self) -> None:
        return None


def scheduler_rank(server_args, gpu_id, tp_rank, pp_rank, dp_rank, writer) -> None:
    """A spawn target: sglang's own run_scheduler_process, the Scheduler replaced."""
    from sglang.srt.managers import scheduler

    scheduler.Scheduler = ProbeScheduler
    scheduler.run_scheduler_process(
        server_args, None, gpu_id, tp_rank, pp_rank, dp_rank, writer
    )


# The launching side.


def server_args(**fields):
    """sglang's ServerArgs for the probe model with ``fields``."""
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(model_path=PROBE_MODEL, **fields)


@dataclass(frozen=True)
class Rank:
    gpu_id: int
    tp_rank: int
    pp_rank: int
    dp_rank: Optional[int]


def engine_ranks(server_args) -> list[list[Rank]]:
    """The ranks of one node's engine, per dp rank, with the gpu_id sglang's Engine (or
    its data-parallel controller, which adds each dp rank's base) gives each."""
    tp, pp, step = server_args.tp_size, server_args.pp_size, server_args.gpu_id_step
    groups = []
    for dp in range(server_args.dp_size):
        dp_base = dp * tp * pp * step
        dp_rank = dp if server_args.dp_size > 1 else None
        groups.append(
            [
                Rank(
                    server_args.base_gpu_id + dp_base + p * tp + t * step,
                    t,
                    p,
                    dp_rank,
                )
                for p in range(pp)
                for t in range(tp)
            ]
        )
    return groups


@contextlib.contextmanager
def visible_alone(gpu_id: int, narrow: bool) -> Iterator[int]:
    """With ``narrow``, what the CUDA platform's ``reindex_device_id`` does around a
    spawn: only GPU ``gpu_id`` visible (its entry of CUDA_VISIBLE_DEVICES, if set), as
    GPU 0; else ``gpu_id`` as it is."""
    if not narrow:
        yield gpu_id
        return
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = saved.split(",") if saved else []
    os.environ["CUDA_VISIBLE_DEVICES"] = entries[gpu_id] if entries else str(gpu_id)
    try:
        yield 0
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES")
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


class WarningLog(logging.Handler):
    """Collects every WARNING (and worse) logged in this process, and numa_utils' INFO
    lines (each rank's placement), as ``messages`` and ``info``."""

    _PLACEMENT_LOGGER = "sglang.srt.utils.numa_utils"

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        self.info: list[str] = []
        self._level = logging.NOTSET

    def emit(self, record: logging.LogRecord) -> None:
        line = f"{record.levelname} {record.name}: {record.getMessage()}"
        if record.levelno >= logging.WARNING:
            self.messages.append(line)
        elif record.name == self._PLACEMENT_LOGGER:
            self.info.append(line)

    def __enter__(self) -> WarningLog:
        placement = logging.getLogger(self._PLACEMENT_LOGGER)
        self._level = placement.level
        placement.setLevel(logging.INFO)
        logging.getLogger().addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger().removeHandler(self)
        logging.getLogger(self._PLACEMENT_LOGGER).setLevel(self._level)


def launch(
    server_args,
    *,
    rank: str = "report",
    threads: bool = False,
    gpu_ids: Optional[Sequence[int]] = None,
    touch_mb: int = 0,
    first_spawn: bool = False,
    one_visible_device: bool = False,
    timeout: float = 240,
) -> list[dict]:
    """Start the engine's ranks (those of ``gpu_ids`` only, when given) each inside
    ``configure_subprocess`` and return, per rank in order, its ``gpu_id``, ranks and
    what it reported (``report``), or the error that kept it from starting
    (``error``). ``rank`` is "report" or "scheduler"; ``threads`` starts each dp
    rank's ranks from a thread of its own, all at once. ``one_visible_device`` spawns
    each rank as SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS=1 has sglang do on a CUDA host
    (``maybe_reindex_device_id``): CUDA_VISIBLE_DEVICES narrowed to the rank's GPU, which
    it is given as GPU 0.

    A process's first spawn also starts multiprocessing's resource tracker, with the
    spawn executable in force. Unless ``first_spawn``, that tracker is started here
    beforehand, so the launch shows only how ranks are placed;
    ``first_spawn`` stops it instead, so the first rank is a fresh process's first
    spawn, as an engine's first scheduler is."""
    from multiprocessing import resource_tracker

    from sglang.srt.utils import numa_utils

    if multiprocessing.get_start_method(allow_none=True) != "spawn":
        raise RuntimeError("set the spawn start method first, as sglang's Engine does")
    if first_spawn:
        resource_tracker._resource_tracker._stop()
    else:
        resource_tracker.ensure_running()
    ctx = multiprocessing.get_context("spawn")
    groups = [
        [r for r in group if gpu_ids is None or r.gpu_id in gpu_ids]
        for group in engine_ranks(server_args)
    ]
    groups = [group for group in groups if group]
    rows: dict[Rank, dict] = {}
    together = threading.Barrier(len(groups) if threads else 1)

    def start(group: list[Rank]) -> None:
        together.wait()
        for r in group:
            row = rows[r] = {"gpu_id": r.gpu_id, "tp_rank": r.tp_rank}
            row.update(dp_rank=r.dp_rank, pp_rank=r.pp_rank)
            reader, writer = ctx.Pipe(duplex=False)
            if rank == "scheduler":
                args = (server_args, r.gpu_id, r.tp_rank, r.pp_rank, r.dp_rank)
                proc = ctx.Process(target=scheduler_rank, args=(*args, writer))
            else:
                proc = ctx.Process(target=report_rank, args=(writer, touch_mb))
            try:
                with visible_alone(r.gpu_id, one_visible_device) as gpu_id:
                    with numa_utils.configure_subprocess(server_args, gpu_id):
                        proc.start()
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"
            finally:
                writer.close()
            row["started"] = proc.pid is not None
            row["proc"], row["reader"] = proc, reader

    if threads:
        workers = [threading.Thread(target=start, args=(g,)) for g in groups]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    else:
        for group in groups:
            start(group)
    out = []
    for r in (r for group in groups for r in group):
        row = rows[r]
        proc, reader = row.pop("proc"), row.pop("reader")
        if row["started"]:
            row["report"] = None
            if reader.poll(timeout):
                try:
                    row["report"] = reader.recv()
                except EOFError:  # it exited without reporting
                    pass
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join()
            row["exitcode"] = proc.exitcode
        reader.close()
        out.append(row)
    return out


# A job: scenarios run in one launching process (``launch_ranks.py``).

# seccomp: a filter that fails the calls that set a memory policy with EPERM.
_SECCOMP = {"x86_64": (0xC000003E, (237, 238, 450))}  # mbind, set_mempolicy(_home_node)
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_RET_ERRNO, _RET_ALLOW, _EPERM = 0x00050000, 0x7FFF0000, 1


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_ushort),
        ("jt", ctypes.c_ubyte),
        ("jf", ctypes.c_ubyte),
        ("k", ctypes.c_uint),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def deny_memory_policy() -> None:
    """Install a seccomp filter on this process, which its children inherit, that fails
    mbind, set_mempolicy and set_mempolicy_home_node with EPERM, as a container
    runtime's seccomp profile can. It cannot be removed."""
    arch, calls = _SECCOMP[os.uname().machine]
    load, jeq, ret = 0x20, 0x15, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_RET|K
    n = len(calls)
    # 0: the arch, another one skips to "allow"; 2: the call; a listed one jumps to
    # "errno" (n + 4), any other falls through to "allow" (n + 3).
    program = [(load, 0, 0, 4), (jeq, 0, n + 1, arch), (load, 0, 0, 0)]
    program += [(jeq, n - i, 0, call) for i, call in enumerate(calls)]
    program += [(ret, 0, 0, _RET_ALLOW), (ret, 0, 0, _RET_ERRNO | _EPERM)]
    filters = (_SockFilter * len(program))(*(_SockFilter(*op) for op in program))
    fprog = _SockFprog(len(program), filters)
    libc = ctypes.CDLL(None, use_errno=True)
    for args in (
        (_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0),
        (_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0),
    ):
        if libc.prctl(*(ctypes.c_ulong(a) for a in args)) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"prctl{args[:2]}: {os.strerror(error)}")


def run_scenario(scenario: dict, *, timeout: float) -> dict:
    """One launch of ``scenario``'s engine with its settings (``env``: a value, or None
    to unset); its rows and the warnings this process logged meanwhile."""
    saved = {name: os.environ.get(name) for name in scenario.get("env", {})}
    result: dict = {"name": scenario.get("name", "")}
    try:
        for name, value in scenario.get("env", {}).items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        with WarningLog() as log:
            try:
                result["ranks"] = launch(
                    server_args(**scenario["engine"]),
                    rank=scenario.get("rank", "report"),
                    threads=scenario.get("threads", False),
                    gpu_ids=scenario.get("gpu_ids"),
                    touch_mb=scenario.get("touch_mb", 0),
                    first_spawn=scenario.get("first_spawn", False),
                    one_visible_device=scenario.get("one_visible_device", False),
                    timeout=timeout,
                )
            except Exception as e:
                result["error"] = f"{type(e).__name__}: {e}"
        result["warnings"], result["info"] = log.messages, log.info
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return result


def run_job(job: dict) -> list[dict]:
    """``job``'s scenarios, in order, in this process (the engine's launching one)."""
    multiprocessing.set_start_method("spawn", force=True)  # as sglang's Engine does
    if job.get("deny_memory_policy"):
        deny_memory_policy()
    timeout = job.get("timeout", 240)
    return [run_scenario(s, timeout=timeout) for s in job["scenarios"]]


RESULT = "RESULT "


def parse_results(stdout: str) -> list[dict]:
    """The results ``launch_ranks.py`` printed (its children share its stdout)."""
    import json

    lines = [line for line in stdout.splitlines() if line.startswith(RESULT)]
    if len(lines) != 1:
        raise ValueError(f"expected one {RESULT.strip()} line:\n{stdout[-3000:]}")
    return json.loads(lines[0][len(RESULT) :])
