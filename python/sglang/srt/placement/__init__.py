"""Where each scheduler rank runs: one ProcessPlacement per rank, resolved once on the rank's host."""

from sglang.srt.placement.cpulist import CpuListError, format_cpulist, parse_cpulist
from sglang.srt.placement.plan import HostFacts, place_gpu_id, plan_engine, plan_node
from sglang.srt.placement.policy import PlacementPolicy
from sglang.srt.placement.ranks import local_ranks
from sglang.srt.placement.resolve import describe, resolve_placement
from sglang.srt.placement.strategy import HostCapabilities
from sglang.srt.placement.types import (
    Accelerator,
    HostTopology,
    PlacementError,
    ProcessAffinity,
    ProcessPlacement,
    RankIdentity,
    TopologyError,
)

__all__ = [
    "Accelerator",
    "CpuListError",
    "HostCapabilities",
    "HostFacts",
    "HostTopology",
    "PlacementError",
    "PlacementPolicy",
    "ProcessAffinity",
    "ProcessPlacement",
    "RankIdentity",
    "TopologyError",
    "describe",
    "format_cpulist",
    "local_ranks",
    "parse_cpulist",
    "place_gpu_id",
    "plan_engine",
    "plan_node",
    "resolve_placement",
]
