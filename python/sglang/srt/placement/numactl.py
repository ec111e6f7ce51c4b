"""numactl's options as upstream writes them (``--cpunodebind=N --membind=N``, or
``--physcpubind=`` every CPU), and what a set of them binds."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from typing import Iterable, Optional

from sglang.srt.placement.types import MemPolicy


def find_numactl() -> Optional[str]:
    return shutil.which("numactl")


def cpu_mem_args(
    *, node: int, cpus: Iterable[int], whole_node: bool, mem_nodes: Iterable[int]
) -> str:
    """The CPUs (the whole ``node``, or each CPU listed) and the memory nodes."""
    listed = ",".join(map(str, sorted(cpus)))
    cpu = f"--cpunodebind={node}" if whole_node else f"--physcpubind={listed}"
    memory = ",".join(map(str, sorted(mem_nodes)))
    return f"{cpu} --membind={memory}" if memory else cpu


def strip_memory_args(numactl_args: str) -> str:
    """``numactl_args`` without its memory policy: the CPU binding only."""
    return " ".join(
        word
        for word in numactl_args.split()
        if not word.startswith(("--membind", "--preferred"))
    )


@dataclass(frozen=True)
class Bound:  # what a numactl option set binds; cpus empty for --cpunodebind
    cpu_nodes: frozenset[int]
    cpus: frozenset[int]
    mem_policy: MemPolicy
    mem_nodes: frozenset[int]


def parse_args(numactl_args: str) -> Bound:
    """Reads what ``cpu_mem_args`` wrote (and the probe's weaker forms of it)."""
    found: dict[str, frozenset[int]] = {}
    for word in numactl_args.split():
        name, _, value = word.partition("=")
        found[name] = frozenset(int(n) for n in value.split(",") if n)
    policy = MemPolicy.NONE
    if "--membind" in found:
        policy = MemPolicy.BIND
    elif "--preferred" in found:
        policy = MemPolicy.PREFERRED
    mems = found.get("--membind", found.get("--preferred", frozenset()))
    return Bound(
        found.get("--cpunodebind", frozenset()),
        found.get("--physcpubind", frozenset()),
        policy,
        mems,
    )
