"""Which scheduler ranks a node launches and the GPU id sglang hands each one.

This is sglang 0.5.23's own arithmetic, in one place: the engine
(``entrypoints/engine.py``, ``_calculate_rank_ranges``) and the data-parallel
controller (``managers/data_parallel_controller.py``) each compute a rank's
``gpu_id`` before they spawn it inside ``configure_subprocess(server_args,
gpu_id)``, and bootstrap uses that same ``gpu_id`` as a CPU rank's
``numa_index``. With ``SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS=1`` the spawn
happens under ``maybe_reindex_device_id``: ``CUDA_VISIBLE_DEVICES`` is
narrowed to the rank's one GPU and the id becomes 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional

from sglang.srt.placement.types import RankIdentity

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs


@dataclass(frozen=True)
class RankRanges:
    """The pipeline and tensor ranks one node runs, and how many of each it holds."""

    pp_ranks: range
    tp_ranks: range
    pp_per_node: int
    tp_per_node: int


def rank_ranges(
    *, tp_size: int, pp_size: int, nnodes: int, node_rank: int
) -> RankRanges:
    """The engine's ``_calculate_rank_ranges`` (the data-parallel controller's is the same)."""
    pp_per_node = max(pp_size // nnodes, 1)
    nnodes_per_pp_rank = max(nnodes // pp_size, 1)
    pp_start = pp_per_node * (node_rank // nnodes_per_pp_rank)
    tp_per_node = tp_size // nnodes_per_pp_rank
    tp_start = tp_per_node * (node_rank % nnodes_per_pp_rank)
    return RankRanges(
        pp_ranks=range(pp_start, pp_start + pp_per_node),
        tp_ranks=range(tp_start, tp_start + tp_per_node),
        pp_per_node=pp_per_node,
        tp_per_node=tp_per_node,
    )


def engine_gpu_id(
    *,
    base_gpu_id: int,
    gpu_id_step: int,
    pp_rank: int,
    tp_rank: int,
    ranges: RankRanges,
) -> int:
    """``Engine._launch_scheduler_processes``: the step applies to the TP offset only."""
    return (
        base_gpu_id
        + (pp_rank % ranges.pp_per_node) * ranges.tp_per_node
        + (tp_rank % ranges.tp_per_node) * gpu_id_step
    )


def dp_controller_gpu_id(
    *,
    base_gpu_id: int,
    gpu_id_step: int,
    dp_rank: int,
    tp_size: int,
    pp_size: int,
    pp_rank: int,
    tp_rank: int,
    ranges: RankRanges,
) -> int:
    """``DataParallelController``: each dp rank starts ``tp_size * pp_size * step`` ids after the previous."""
    dp_base = dp_rank * tp_size * pp_size * gpu_id_step
    return (
        base_gpu_id
        + dp_base
        + engine_gpu_id(
            base_gpu_id=0,
            gpu_id_step=gpu_id_step,
            pp_rank=pp_rank,
            tp_rank=tp_rank,
            ranges=ranges,
        )
    )


def local_ranks(server_args: "ServerArgs") -> tuple[RankIdentity, ...]:
    """The ranks this ``node_rank`` launches, in launch order (dp, pp, tp), with sglang's GPU ids.

    One replica (``dp_size == 1``) is launched by the engine; several by the
    data-parallel controller, one thread per dp rank, with its own formula.
    """
    tp, pp, dp = server_args.tp_size, server_args.pp_size, server_args.dp_size
    ranges = rank_ranges(
        tp_size=tp,
        pp_size=pp,
        nnodes=server_args.nnodes,
        node_rank=server_args.node_rank,
    )
    base, step = server_args.base_gpu_id, server_args.gpu_id_step
    ranks = []
    for dp_rank in range(dp):
        for pp_rank in ranges.pp_ranks:
            for tp_rank in ranges.tp_ranks:
                if dp == 1:
                    gpu_id = engine_gpu_id(
                        base_gpu_id=base,
                        gpu_id_step=step,
                        pp_rank=pp_rank,
                        tp_rank=tp_rank,
                        ranges=ranges,
                    )
                else:
                    gpu_id = dp_controller_gpu_id(
                        base_gpu_id=base,
                        gpu_id_step=step,
                        dp_rank=dp_rank,
                        tp_size=tp,
                        pp_size=pp,
                        pp_rank=pp_rank,
                        tp_rank=tp_rank,
                        ranges=ranges,
                    )
                ranks.append(
                    RankIdentity(
                        dp_rank=dp_rank,
                        pp_rank=pp_rank,
                        tp_rank=tp_rank,
                        gpu_id=gpu_id,
                    )
                )
    return tuple(ranks)


def rank_of_gpu_id(server_args: "ServerArgs", gpu_id: int) -> Optional[RankIdentity]:
    """The local rank sglang hands ``gpu_id``, or None (a re-indexed or foreign id)."""
    for rank in local_ranks(server_args):
        if rank.gpu_id == gpu_id:
            return rank
    return None


ONE_VISIBLE_DEVICE_VAR = "SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS"


def reindexed(gpu_id: int, env: Mapping[str, str]) -> tuple[int, dict[str, str]]:
    """What ``maybe_reindex_device_id`` hands a CUDA spawn: (0, env with one visible GPU).

    As ``platforms/cuda.py``: the ``gpu_id``-th entry of ``CUDA_VISIBLE_DEVICES``,
    or the id itself when the variable is unset or empty.
    """
    visible = env.get("CUDA_VISIBLE_DEVICES") or ""
    entries = visible.split(",") if visible else []
    physical = entries[gpu_id] if entries and gpu_id < len(entries) else str(gpu_id)
    return 0, {**env, "CUDA_VISIBLE_DEVICES": physical}
