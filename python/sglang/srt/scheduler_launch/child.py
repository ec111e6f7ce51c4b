"""A launched rank's own side: its identity (title, log prefix), its placement applied, and the spawned child's entry.

The scheduler object is whatever ``target`` the launcher hands in (a callable
``target(server_args=, placement=, rank=)`` returning an object with optional
``ready_info()`` and ``event_loop()``), so that placement can be exercised
with or without a model.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import faulthandler
import logging
import signal
import sys
import traceback
from typing import Any, Callable, Optional

from sglang.srt.placement import settings
from sglang.srt.placement.types import ProcessPlacement, RankIdentity, Strategy
from sglang.srt.scheduler_launch.common import ready_info_of

logger = logging.getLogger(__name__)

_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1


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
            from sglang.srt.utils.numa_utils import get_numa_node_if_available, numa_bind_to_node

            numa_node = get_numa_node_if_available(server_args, gpu_id)
            if numa_node is not None:
                numa_bind_to_node(numa_node)
                logger.info(f"{who}: bound to NUMA node {numa_node} in the child (SGLANG_NUMA_BIND_V2=0)")
        return prefix

    _apply_in_child(placement, who=who)
    return prefix


def _apply_in_child(placement: ProcessPlacement, *, who: str) -> None:
    summary = _placement_summary(placement)
    if placement.strategy == Strategy.IN_PROCESS:
        from sglang.srt.placement import apply

        apply.bind_in_process(placement)
        logger.info(f"{who}: bound in-process: {summary}")
    elif placement.strategy == Strategy.V1:
        if placement.numa_node is None:
            logger.warning(f"{who}: legacy placement without a NUMA node, nothing bound ({summary})")
            return
        from sglang.srt.utils.numa_utils import numa_bind_to_node

        numa_bind_to_node(placement.numa_node)
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


def run_scheduler_process(
    *,
    server_args: Any,
    placement_json: Optional[str],
    rank: RankIdentity,
    target: Callable[..., Any],
    pipe_writer: Any,
) -> None:
    """Multiprocessing child entry: configure, build the scheduler, report readiness or the error, run it.

    Every outcome reaches the parent through ``pipe_writer``, and the child
    exits with a non-zero status on failure, so the parent never waits on a
    child that is gone.
    """
    _die_with_parent()
    placement = ProcessPlacement.from_json(placement_json) if placement_json else None
    stage = "start"
    try:
        configure_scheduler_rank(server_args, rank=rank, placement=placement)
        scheduler = target(server_args=server_args, placement=placement, rank=rank)
        info = ready_info_of(scheduler)
        pipe_writer.send({"status": "ready", "info": info})
        stage = "run"
        event_loop = getattr(scheduler, "event_loop", None)
        if event_loop is not None:
            event_loop()
        pipe_writer.send({"status": "done"})
    except BaseException as exc:  # noqa: BLE001 - the parent must hear about every failure, SystemExit included
        tb = traceback.format_exc()
        logger.error(f"{rank.label}: scheduler failed during {stage}: {exc!r}\n{tb}")
        try:
            pipe_writer.send({"status": "error", "stage": stage, "error": f"{type(exc).__name__}: {exc}", "traceback": tb})
        except (OSError, ValueError):
            pass
        sys.exit(1)
    finally:
        try:
            pipe_writer.close()
        except OSError:
            pass


def _libc() -> Optional[ctypes.CDLL]:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None


def _die_with_parent() -> None:
    # A scheduler outliving its engine would keep its accelerator and shared memory.
    libc = _libc()
    if libc is not None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
