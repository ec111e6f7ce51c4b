"""Which scheduler ranks a node launches and the GPU id sglang hands each one: the
engine's and the data-parallel controller's arithmetic in one place (bootstrap uses
the id as a CPU rank's ``numa_index``)."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Mapping, NamedTuple

from sglang.srt.placement.types import RankIdentity

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs


class RankRanges(NamedTuple):
    pp_ranks: range
    tp_ranks: range


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
        range(pp_start, pp_start + pp_per_node), range(tp_start, tp_start + tp_per_node)
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
    pp_per_node, tp_per_node = len(ranges.pp_ranks), len(ranges.tp_ranks)
    return (
        base_gpu_id
        + (pp_rank % pp_per_node) * tp_per_node
        + (tp_rank % tp_per_node) * gpu_id_step
    )


def local_ranks(server_args: "ServerArgs") -> tuple[RankIdentity, ...]:
    """The ranks this ``node_rank`` launches, in launch order (dp, pp, tp)."""
    tp, pp, step = server_args.tp_size, server_args.pp_size, server_args.gpu_id_step
    nodes = dict(nnodes=server_args.nnodes, node_rank=server_args.node_rank)
    ranges = rank_ranges(tp_size=tp, pp_size=pp, **nodes)
    ids = dict(base_gpu_id=server_args.base_gpu_id, gpu_id_step=step, ranges=ranges)
    ranks = []
    for dp_rank, pp_rank, tp_rank in itertools.product(
        range(server_args.dp_size), ranges.pp_ranks, ranges.tp_ranks
    ):
        gpu_id = engine_gpu_id(pp_rank=pp_rank, tp_rank=tp_rank, **ids)
        # The DataParallelController's replicas follow one another.
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
