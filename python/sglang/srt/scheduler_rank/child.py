"""A launched rank's own side: its identity (title, log prefix), its placement applied, and the spawned child's entry.

The scheduler object is whatever ``target`` the launcher hands in (a callable
``target(server_args=, placement=, rank=)`` returning an object with optional
``ready_info()`` and ``event_loop()``), so that placement can be exercised
with or without a model.

A spawned rank is started with almost nothing: its label, the pipe it reports
on, and its *lifeline*, a pipe whose write end only the launcher process holds.
Its arguments (server args, target, placement), however large, come through the
lifeline afterwards, and the launcher keeps the write end open for as long as
it lives: end of file on the lifeline means the launcher process is gone, from
whichever thread it was started. The rank watches it from a daemon thread that
starts before anything heavy is unpickled or imported, and exits when it ends.
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import pickle
import select
import signal
import struct
import sys
import threading
import traceback
from typing import Any, Callable, Optional

from sglang.srt.placement import settings
from sglang.srt.placement.types import ProcessPlacement, RankIdentity, Strategy
from sglang.srt.scheduler_rank.common import read_back, ready_info_of, report_mismatches

logger = logging.getLogger(__name__)

_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1

_LENGTH = struct.Struct("!Q")
LAUNCHER_GONE_EXIT_STATUS = 70
"""Exit status of a rank that left because its launcher process is gone (EX_SOFTWARE)."""
_PARENT_CHECK_S = 1.0


def scheduler_log_prefix(
    server_args: Any,
    *,
    tp_rank: int,
    moe_ep_rank: int = 0,
    pp_rank: int = 0,
    dp_rank: Optional[int] = None,
) -> str:
    """Upstream's prefix order: DP (when the rank has one), then PP, TP and EP (when their size is above one)."""
    prefix = ""
    if dp_rank is not None:
        prefix += f" DP{dp_rank}"
    if getattr(server_args, "pp_size", 1) > 1:
        prefix += f" PP{pp_rank}"
    if getattr(server_args, "tp_size", 1) > 1:
        prefix += f" TP{tp_rank}"
    if getattr(server_args, "ep_size", 1) > 1:
        prefix += f" EP{moe_ep_rank}"
    return prefix


def set_process_title(title: str) -> None:
    """``ps`` shows the whole title when setproctitle is installed; otherwise the kernel's 15-character comm."""
    try:
        import setproctitle  # type: ignore[import-not-found]
    except ImportError:
        setproctitle = None
    if setproctitle is not None:
        setproctitle.setproctitle(title)
        return
    libc = _libc()
    if libc is not None:
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(title.encode()[:15]), 0, 0, 0)


def configure_logger(server_args: Any, *, prefix: str) -> None:
    """Root logging for a scheduler process, every line tagged with the rank's prefix (upstream's format)."""
    level = str(getattr(server_args, "log_level", "info")).upper()
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format=f"[%(asctime)s{prefix}] %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        force=True,
    )


def configure_scheduler_process(
    server_args: Any,
    gpu_id: Optional[int],
    tp_rank: int,
    moe_ep_rank: int = 0,
    pp_rank: int = 0,
    dp_rank: Optional[int] = None,
    *,
    placement: Optional[ProcessPlacement] = None,
) -> str:
    """Name the process, tag its logs and apply the in-process part of its placement; returns the log prefix.

    ``exec`` placements were applied by numactl before the interpreter started,
    so nothing is done for them here. Without a placement the legacy switch
    ``SGLANG_NUMA_BIND_V2=0`` still binds the child to its GPU's node, as upstream.
    """
    prefix = scheduler_log_prefix(
        server_args, tp_rank=tp_rank, moe_ep_rank=moe_ep_rank, pp_rank=pp_rank, dp_rank=dp_rank
    )
    set_process_title(f"sglang::scheduler{prefix.replace(' ', '_')}")
    faulthandler.enable()
    configure_logger(server_args, prefix=prefix)
    who = prefix.strip() or f"TP{tp_rank}"

    if placement is None:
        if not settings.bind_v2() and gpu_id is not None:
            from sglang.srt.placement.apply import bind_legacy_v1
            from sglang.srt.placement.gpu_node import gpu_numa_node

            numa_node = gpu_numa_node(server_args, gpu_id)
            if numa_node is not None:
                bind_legacy_v1(numa_node)
                logger.info(f"{who}: bound to NUMA node {numa_node} in the child (SGLANG_NUMA_BIND_V2=0)")
        return prefix

    apply_in_rank(placement, who=who)
    return prefix


def apply_in_rank(placement: ProcessPlacement, *, who: str) -> None:
    """Apply the part of ``placement`` that is done inside the rank (in-process or legacy V1); log what holds."""
    summary = _placement_summary(placement)
    if placement.strategy == Strategy.IN_PROCESS:
        from sglang.srt.placement import apply

        apply.bind_in_process(placement)
        logger.info(f"{who}: bound in-process: {summary}")
    elif placement.strategy == Strategy.V1:
        if placement.numa_node is None:
            logger.warning(f"{who}: legacy placement without a NUMA node, nothing bound ({summary})")
            return
        from sglang.srt.placement.apply import bind_legacy_v1

        bind_legacy_v1(placement.numa_node)
        logger.info(f"{who}: bound to NUMA node {placement.numa_node} in the child (legacy V1)")
    elif placement.strategy == Strategy.EXEC:
        logger.info(f"{who}: started under numactl {' '.join(placement.numactl_args)}: {summary}")
    else:
        reasons = "; ".join(placement.reasons) or "no reason recorded"
        logger.info(f"{who}: not bound ({reasons})")


def _placement_summary(placement: ProcessPlacement) -> str:
    data = placement.to_dict()
    return (
        f"node={data['numa_node']} cpus={data['cpus'] or '-'} mem={placement.mem_policy}"
        f":{data['mem_nodes'] or '-'} strategy={placement.strategy}"
    )


def configure_scheduler_rank(server_args: Any, *, rank: RankIdentity,
                             placement: Optional[ProcessPlacement]) -> str:
    """``configure_scheduler_process`` for a launcher's rank: the one call both launchers make in the child."""
    return configure_scheduler_process(
        server_args,
        rank.gpu_id,
        rank.tp_rank,
        pp_rank=rank.pp_rank,
        dp_rank=rank.dp_rank if getattr(server_args, "dp_size", 1) > 1 else None,
        placement=placement,
    )


def frame_arguments(arguments: dict) -> bytes:
    """A rank's arguments as the launcher writes them to its lifeline: a length, then the pickle."""
    from multiprocessing.reduction import ForkingPickler

    data = bytes(ForkingPickler.dumps(arguments))
    return _LENGTH.pack(len(data)) + data


class Lifeline:
    """The rank's end of the launcher's pipe: its arguments first, then end of file when the launcher is gone.

    ``parent_pid`` is also compared with ``getppid()`` now and then, for a write end
    that leaked into another process (a ``fork()`` of the launcher) and keeps the
    pipe open; None skips that (a forkserver is the rank's parent, not the launcher).
    """

    def __init__(self, conn: Any, *, label: str, parent_pid: Optional[int]) -> None:
        self._conn = conn  # keeps the descriptor open
        self._fd = conn.fileno()
        self._label = label
        self._parent_pid = parent_pid
        self._arguments = b""
        self._received = threading.Event()

    def start(self) -> "Lifeline":
        self.check_parent()
        threading.Thread(target=self._watch, name="sglang-launcher-watch", daemon=True).start()
        return self

    def arguments(self) -> bytes:
        """The pickled arguments; blocks until they are all here (the process exits if the launcher dies first)."""
        self._received.wait()
        return self._arguments

    def check_parent(self) -> None:
        if self._parent_pid is not None and os.getppid() != self._parent_pid:
            self._launcher_gone(f"its parent is now process {os.getppid()}")

    def _watch(self) -> None:
        header = self._read_exactly(_LENGTH.size)
        (size,) = _LENGTH.unpack(header)
        self._arguments = self._read_exactly(size)
        self._received.set()
        while self._read_some():
            pass  # nothing more is expected; end of file is the news
        self._launcher_gone("its pipe reached end of file")

    def _read_exactly(self, size: int) -> bytes:
        parts: list[bytes] = []
        while size:
            chunk = self._read_some(size)
            if not chunk:
                self._launcher_gone("its pipe reached end of file before the rank's arguments were all sent")
            parts.append(chunk)
            size -= len(chunk)
        return b"".join(parts)

    def _read_some(self, size: int = 1 << 16) -> bytes:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        while not poller.poll(_PARENT_CHECK_S * 1000):
            self.check_parent()
        return os.read(self._fd, size)

    def _launcher_gone(self, why: str) -> None:
        # Written straight to the descriptor: no lock that the main thread may hold, nothing to flush.
        message = (f"{self._label}: launcher process {self._parent_pid or '?'} is gone ({why}); "
                   f"scheduler process {os.getpid()} exits\n")
        try:
            os.write(2, message.encode(errors="replace"))
        finally:
            os._exit(LAUNCHER_GONE_EXIT_STATUS)


def run_spawned_rank(*, label: str, lifeline: Any, pipe_writer: Any, parent_pid: Optional[int],
                     die_with_parent_thread: bool) -> None:
    """A spawned rank's entry: watch the launcher first, then take the arguments from the lifeline and run.

    ``die_with_parent_thread`` also arms the kernel's parent-death signal, which
    fires when the *thread* that started the child exits; the launcher asks for it
    only from its main thread, whose end is the process's.
    """
    watch = Lifeline(lifeline, label=label, parent_pid=parent_pid).start()
    if die_with_parent_thread:
        _arm_parent_death_signal()
        watch.check_parent()  # the launcher may have died before the signal was armed
    try:
        arguments = pickle.loads(watch.arguments())
    except BaseException as exc:  # noqa: BLE001 - e.g. the target's module does not import here
        _report_failure(pipe_writer, label=label, stage="start", exc=exc)
        sys.exit(1)
    run_scheduler_process(**arguments, pipe_writer=pipe_writer)


def run_scheduler_process(
    *,
    server_args: Any,
    placement_json: Optional[str],
    rank: RankIdentity,
    target: Callable[..., Any],
    pipe_writer: Any,
) -> None:
    """Configure, check the binding, build the scheduler, report readiness or the error, run it.

    Every outcome reaches the parent through ``pipe_writer``, and the child
    exits with a non-zero status on failure, so the parent never waits on a
    child that is gone.
    """
    placement = ProcessPlacement.from_json(placement_json) if placement_json else None
    stage = "start"
    try:
        configure_scheduler_rank(server_args, rank=rank, placement=placement)
        binding = report_binding(placement, who=rank.label)
        scheduler = target(server_args=server_args, placement=placement, rank=rank)
        info = ready_info_of(scheduler)
        pipe_writer.send({"status": "ready", "info": info, "binding": binding})
        stage = "run"
        event_loop = getattr(scheduler, "event_loop", None)
        if event_loop is not None:
            event_loop()
        pipe_writer.send({"status": "done"})
    except BaseException as exc:  # noqa: BLE001 - the parent must hear about every failure, SystemExit included
        _report_failure(pipe_writer, label=rank.label, stage=stage, exc=exc)
        sys.exit(1)
    finally:
        try:
            pipe_writer.close()
        except OSError:
            pass


def report_binding(placement: Optional[ProcessPlacement], *, who: str) -> dict:
    """Read this rank's binding back and log how it differs from ``placement`` (raise under the crash setting).

    The report (pid, observed binding, mismatches) goes to the launcher with the
    readiness message; {} without a placement or when it could not be read.
    """
    if placement is None:
        return {}
    try:
        report = read_back(placement)
    except OSError as exc:
        logger.warning(f"{who}: could not read this scheduler's binding back: {exc}")
        return {}
    report_mismatches(placement, report, who=who, warn=logger.warning)
    return report


def _report_failure(pipe_writer: Any, *, label: str, stage: str, exc: BaseException) -> None:
    tb = traceback.format_exc()
    logger.error(f"{label}: scheduler failed during {stage}: {exc!r}\n{tb}")
    try:
        pipe_writer.send({"status": "error", "stage": stage, "error": f"{type(exc).__name__}: {exc}", "traceback": tb})
    except (OSError, ValueError):
        pass


def _libc() -> Optional[ctypes.CDLL]:
    # The C library this process already loaded: no search (find_library runs ldconfig in a subprocess).
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _arm_parent_death_signal() -> None:
    # SIGKILL from the kernel, even while this process holds the GIL in a long call.
    libc = _libc()
    if libc is not None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
