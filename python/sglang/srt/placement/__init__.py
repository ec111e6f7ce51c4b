"""Where each scheduler rank runs: one ProcessPlacement per rank, resolved once on the rank's host."""

from sglang.srt.placement.cpulist import CpuListError, format_cpulist, parse_cpulist
from sglang.srt.placement.resolve import (
    HostCapabilities,
    PlacementPolicy,
    cpu_rank_cpus,
    describe,
    local_ranks,
    log_placements,
    plan_engine,
    resolve_placement,
    resolve_rank,
)
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
    "HostTopology",
    "PlacementError",
    "PlacementPolicy",
    "ProcessAffinity",
    "ProcessPlacement",
    "RankIdentity",
    "TopologyError",
    "cpu_rank_cpus",
    "describe",
    "format_cpulist",
    "local_ranks",
    "log_placements",
    "parse_cpulist",
    "plan_engine",
    "resolve_placement",
    "resolve_rank",
]
