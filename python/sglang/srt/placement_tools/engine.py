"""A whole engine as the tools see it: which ranks a node launches, with sglang's own
rank arithmetic, each placed as sglang's spawn (or Ray actor) of its GPU id will be;
how a placement reads as a row; and planning from a snapshot or a ``--gpus`` list."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Iterator, Mapping, NamedTuple, Optional, Sequence, Union

from sglang.srt.placement import settings
from sglang.srt.placement.cpulist import format_cpulist, parse_cpulist
from sglang.srt.placement.devices import canonical_pci_address
from sglang.srt.placement.numactl import LadderOutcome, NumactlProber
from sglang.srt.placement.plan import noted, place_gpu_id
from sglang.srt.placement.policy import PlacementPolicy
from sglang.srt.placement.resolve import HostCapabilities, HostFacts
from sglang.srt.placement.types import (
    HostTopology,
    Launcher,
    MemPolicy,
    ProcessPlacement,
    RankIdentity,
    SettingError,
    Strategy,
)

# The engine's settings, read where each rank runs: ``verify`` hands the driver's
# values to its Ray job's workers.
ENGINE_POLICY_VARS = (
    "SGLANG_NUMA_BIND_V2",
    "SGLANG_AUTO_NUMA_BIND",
    "SGLANG_CRASH_ON_NUMA_BIND_FAILURE",
    "SGLANG_NUMA_AFFINITY_MODE",
    "SGLANG_CPU_OMP_THREADS_BIND",
)
_GPUS_EXAMPLE = "e.g. --gpus 0000:17:00.0,0000:81:00.0."


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


def local_ranks(server_args: object) -> tuple[RankIdentity, ...]:
    """The ranks this ``node_rank`` launches, in launch order (dp, pp, tp)."""
    a = server_args
    ranges = rank_ranges(
        tp_size=a.tp_size, pp_size=a.pp_size, nnodes=a.nnodes, node_rank=a.node_rank
    )
    ids = dict(base_gpu_id=a.base_gpu_id, gpu_id_step=a.gpu_id_step, ranges=ranges)
    ranks = []
    for dp_rank, pp_rank, tp_rank in itertools.product(
        range(a.dp_size), ranges.pp_ranks, ranges.tp_ranks
    ):
        gpu_id = engine_gpu_id(pp_rank=pp_rank, tp_rank=tp_rank, **ids)
        # The DataParallelController's replicas follow one another.
        gpu_id += dp_rank * a.tp_size * a.pp_size * a.gpu_id_step
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


def check_gpus(
    value: Union[str, Sequence[str]], *, topology: HostTopology, gpu_ids: Sequence[int]
) -> tuple[str, ...]:
    """``--gpus`` parsed and checked against the host and the ranks' GPU ids: a typo
    or a missing address is a bad setting, never a rank left unbound."""
    raw = value if isinstance(value, str) else ",".join(map(str, value))
    if not raw.strip():
        raise SettingError(
            f"--gpus is empty; give one PCI address per device index, {_GPUS_EXAMPLE}"
        )
    found: list[str] = []
    for position, part in enumerate(raw.split(",")):
        address = canonical_pci_address(part)
        if address is None:
            raise SettingError(
                f"--gpus={raw!r}: entry {position} ({part.strip()!r}) is not a PCI "
                f"address; expected dddd:bb:dd.f or bb:dd.f, {_GPUS_EXAMPLE}"
            )
        if address in found:
            raise SettingError(
                f"--gpus={raw!r}: {address} is listed twice (entries "
                f"{found.index(address)} and {position}); each device index "
                f"needs its own GPU, {_GPUS_EXAMPLE}"
            )
        if topology.pci_device(address) is None:
            raise SettingError(
                f"--gpus: {address} (device index {position}) is not among the "
                f"{len(topology.pci_devices)} PCI devices read from {topology.root}; "
                f"check it with `lspci -D`, {_GPUS_EXAMPLE}"
            )
        found.append(address)
    if gpu_ids and max(gpu_ids) >= len(found):
        top = max(gpu_ids)
        raise SettingError(
            f"--gpus lists {len(found)} address(es) but a rank uses GPU id {top}: list "
            f"one PCI address per device index 0..{top} ({','.join(found)} given), "
            f"{_GPUS_EXAMPLE}"
        )
    return tuple(found)


@dataclasses.dataclass(frozen=True)
class ListedGpus:
    """``--gpus``: the PCI address of each device index, as a runtime would say."""

    addresses: tuple[str, ...]
    name: str = "--gpus"

    def pci_by_index(self, index: int) -> Optional[str]:
        return self.addresses[index] if index < len(self.addresses) else None

    def pci_by_uuid(self, uuid: str) -> Optional[str]:
        return None

    @contextlib.contextmanager
    def opener(self, device: str, topology: HostTopology) -> Iterator["ListedGpus"]:
        yield self


class AssumedNumactl(NumactlProber):
    """Stands in for the prober when planning from a sysfs snapshot: nothing runs."""

    def __init__(self, *, root: str) -> None:
        super().__init__(numactl_path="numactl")
        self.root = root

    def probe(self, args: Sequence[str]) -> Optional[str]:
        return None

    def ladder(
        self,
        *,
        cpu_args: Sequence[str],
        mem_policy: MemPolicy,
        mem_nodes: Sequence[int],
        preferred_node: Optional[int],
    ) -> LadderOutcome:
        outcome = super().ladder(
            cpu_args=cpu_args,
            mem_policy=mem_policy,
            mem_nodes=mem_nodes,
            preferred_node=preferred_node,
        )
        reason = (
            f"planned from the snapshot {self.root}: assumes numactl there accepts "
            f"{' '.join(outcome.args)} (not probed)"
        )
        return dataclasses.replace(outcome, reasons=(reason,))


def snapshot_capabilities(root: str) -> HostCapabilities:
    return HostCapabilities(numactl=AssumedNumactl(root=root), libnuma=True)


def plan_engine(
    server_args: object,
    *,
    launcher: Launcher = Launcher.MP,
    policy: Optional[PlacementPolicy] = None,
    facts: Optional[HostFacts] = None,
    env: Optional[Mapping[str, str]] = None,
    gpus: Optional[Sequence[str]] = None,
) -> tuple[ProcessPlacement, ...]:
    """Every rank this host runs, each placed as sglang's spawn of its GPU id will be,
    under ``env``, the launcher's environment (default: this process's)."""
    policy = policy or PlacementPolicy.from_env(server_args, launcher=launcher)
    facts = facts or HostFacts.live()
    env = dict(settings.device_env() if env is None else env)
    # maybe_reindex_device_id spawns each CUDA rank under one visible GPU, as GPU 0.
    reindex = (
        gpus is None
        and policy.device == "cuda"
        and policy.launcher == Launcher.MP
        and settings.one_visible_device_per_process()
    )
    options = {}
    if gpus is not None:  # --gpus names each device index's address outright
        options["runtime"] = ListedGpus(tuple(gpus)).opener
        env = {k: v for k, v in env.items() if k not in settings.VISIBILITY_VARS}
    placements = []
    for rank in local_ranks(server_args):
        gpu_id, spawned_env, note = rank.gpu_id, env, None
        if reindex:
            gpu_id, spawned_env = reindexed(rank.gpu_id, env)
            note = (
                f"SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS=1: GPU {rank.gpu_id} is "
                f"spawned as GPU {gpu_id} with "
                f"CUDA_VISIBLE_DEVICES={spawned_env['CUDA_VISIBLE_DEVICES']}"
            )
        placement = place_gpu_id(
            gpu_id, policy=policy, facts=facts, env=spawned_env, rank=rank, **options
        )
        placements.append(noted(placement, note) if note else placement)
    return tuple(placements)


def describe(p: ProcessPlacement) -> str:
    gpu_id, why = p.rank.gpu_id, "; ".join(p.reasons)
    # A CPU rank's id is its numa_index; only an accelerator has a PCI address.
    gpu = "" if gpu_id is None else f" GPU {gpu_id}" if p.pci else f" gpu_id {gpu_id}"
    head = f"[{p.label}]{gpu}{f' ({p.pci})' if p.pci else ''}:"
    if not p.bound:
        return f"{head} not bound -- {why}"
    mem = {"bind": "membind", "preferred": "preferred"}.get(p.mem_policy)
    mem = f"{mem} {format_cpulist(p.mem_nodes)}" if mem else "memory unbound"
    cpus = format_cpulist(p.cpus)
    return f"{head} node {p.numa_node} CPUs {cpus} {mem} via {p.strategy} -- {why}"


def to_dict(p: ProcessPlacement) -> dict[str, object]:
    data = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)[1:]}
    data.update(
        cpus=format_cpulist(p.cpus),
        mem_nodes=format_cpulist(p.mem_nodes),
        mem_policy=p.mem_policy.value,
        strategy=p.strategy.value,
        launcher=str(p.launcher),
        reasons=list(p.reasons),
        numactl_args=list(p.numactl_args),
    )
    return {**dataclasses.asdict(p.rank), **data}


def from_dict(data: Mapping[str, object]) -> ProcessPlacement:
    """Reads what ``to_dict`` wrote."""
    given = {f.name: data[f.name] for f in dataclasses.fields(ProcessPlacement)[1:]}
    given.update(
        cpus=parse_cpulist(data["cpus"]),
        mem_nodes=parse_cpulist(data["mem_nodes"]),
        mem_policy=MemPolicy(data["mem_policy"]),
        strategy=Strategy(data["strategy"]),
        launcher=Launcher(data["launcher"]),
        reasons=tuple(data["reasons"]),
        numactl_args=tuple(data["numactl_args"]),
    )
    keys = ("dp_rank", "pp_rank", "tp_rank", "gpu_id")
    return ProcessPlacement(rank=RankIdentity(*(data[k] for k in keys)), **given)
