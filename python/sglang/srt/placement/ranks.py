"""Which scheduler ranks a node launches and the GPU id sglang hands each one.

sglang 0.5.23's own arithmetic, in one place: the engine (``_calculate_rank_ranges``)
and the data-parallel controller each compute a rank's ``gpu_id`` before spawning it
inside ``configure_subprocess(server_args, gpu_id)``; bootstrap uses the same id as a
CPU rank's ``numa_index``.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Mapping, NamedTuple

from sglang.srt.placement.types import RankIdentity

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs


class RankRanges(NamedTuple):
    pp_ranks: range
    tp_ranks: range
    pp_per_node: int
    tp_per_node: int


def rank_ranges(
    *, tp_size: int, pp_size: int, nnodes: int, node_rank: int
) -> RankRanges:
    """The engine's ``_calculate_rank_ranges`` (the data-parallel controller's too)."""
    pp_per_node = max(pp_size // nnodes, 1)
    nnodes_per_pp_rank = max(nnodes // pp_size, 1)
    pp_start = pp_per_node * (node_rank // nnodes_per_pp_rank)
    tp_per_node = tp_size // nnodes_per_pp_rank
    tp_start = tp_per_node * (node_rank % nnodes_per_pp_rank)
    return RankRanges(
        range(pp_start, pp_start + pp_per_node),
        range(tp_start, tp_start + tp_per_node),
        pp_per_node,
        tp_per_node,
    )


def engine_gpu_id(
    *,
    base_gpu_id: int,
    gpu_id_step: int,
    pp_rank: int,
    tp_rank: int,
    ranges: RankRanges,
) -> int:
    """``Engine._launch_scheduler_processes``: the step scales the TP offset only."""
    return (
        base_gpu_id
        + (pp_rank % ranges.pp_per_node) * ranges.tp_per_node
        + (tp_rank % ranges.tp_per_node) * gpu_id_step
    )


def local_ranks(server_args: "ServerArgs") -> tuple[RankIdentity, ...]:
    """The ranks this ``node_rank`` launches, in launch order (dp, pp, tp)."""
    tp, pp, dp = server_args.tp_size, server_args.pp_size, server_args.dp_size
    ranges = rank_ranges(
        tp_size=tp,
        pp_size=pp,
        nnodes=server_args.nnodes,
        node_rank=server_args.node_rank,
    )
    step, ranks = server_args.gpu_id_step, []
    for dp_rank, pp_rank, tp_rank in itertools.product(
        range(dp), ranges.pp_ranks, ranges.tp_ranks
    ):
        gpu_id = engine_gpu_id(
            base_gpu_id=server_args.base_gpu_id,
            gpu_id_step=step,
            pp_rank=pp_rank,
            tp_rank=tp_rank,
            ranges=ranges,
        )
        if dp > 1:  # the DataParallelController's replicas follow one another
            gpu_id += dp_rank * tp * pp * step
        ranks.append(RankIdentity(dp_rank, pp_rank, tp_rank, gpu_id))
    return tuple(ranks)


def reindexed(gpu_id: int, env: Mapping[str, str]) -> tuple[int, dict[str, str]]:
    """What ``maybe_reindex_device_id`` hands a CUDA spawn: id 0, and as the one
    visible GPU the ``gpu_id``-th entry of ``CUDA_VISIBLE_DEVICES`` (the id itself
    when that is unset or empty)."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    entries = visible.split(",") if visible else []
    physical = entries[gpu_id] if gpu_id < len(entries) else str(gpu_id)
    return 0, {**env, "CUDA_VISIBLE_DEVICES": physical}
