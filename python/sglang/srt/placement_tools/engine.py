"""A whole engine as the tools see it: which ranks a node launches, with sglang's own
rank arithmetic, each placed as sglang's spawn (or Ray actor) of its GPU id will be;
how a placement reads as a row; and the ``--gpus`` list."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
from dataclasses import replace
from typing import Iterator, Mapping, Optional, Sequence

from sglang.srt.environ import envs
from sglang.srt.placement import settings
from sglang.srt.placement.cpulist import format_cpulist, parse_cpulist, shown
from sglang.srt.placement.devices import canonical_pci_address
from sglang.srt.placement.facts import FactsHost
from sglang.srt.placement.resolve import resolve_placement
from sglang.srt.placement.settings import PlacementPolicy
from sglang.srt.placement.types import (
    DeviceIndex,
    DeviceRef,
    HostTopology,
    Launcher,
    MemPolicy,
    ProcessPlacement,
    RankIdentity,
    Strategy,
)
from sglang.srt.placement_tools import MAX_GPU_ID, PlanArgs, UsageError

_GPUS_EXAMPLE = "e.g. --gpus 0000:17:00.0,0000:81:00.0."


def node_ranks(
    a: PlanArgs, node_rank: int, dp_rank: int, *, base_gpu_id: int, gpu_id_step: int
) -> Iterator[RankIdentity]:
    """One dp rank's ranks on ``node_rank``: the engine's ``_calculate_rank_ranges``
    (the data-parallel controller's too) and GPU id (the step scales TP only), as a
    spawn numbers it (a CPU rank's index)."""
    pp_per_node = max(a.pp_size // a.nnodes, 1)
    nnodes_per_pp_rank = max(a.nnodes // a.pp_size, 1)
    tp_per_node = a.tp_size // nnodes_per_pp_rank
    pp_start = pp_per_node * (node_rank // nnodes_per_pp_rank)
    tp_start = tp_per_node * (node_rank % nnodes_per_pp_rank)
    numbering = DeviceIndex.CPU_RANK if a.device == "cpu" else DeviceIndex.LOGICAL_GPU
    for pp_rank, tp_rank in itertools.product(
        range(pp_start, pp_start + pp_per_node), range(tp_start, tp_start + tp_per_node)
    ):
        pp_offset = (pp_rank % pp_per_node) * tp_per_node
        gpu_id = base_gpu_id + pp_offset + (tp_rank % tp_per_node) * gpu_id_step
        yield RankIdentity(DeviceRef(numbering, gpu_id), dp_rank, pp_rank, tp_rank)


def local_ranks(server_args: PlanArgs) -> tuple[RankIdentity, ...]:
    """The ranks this ``node_rank`` launches, in launch order (dp, pp, tp); the
    DataParallelController's replicas follow one another."""
    a, ranks = server_args, []
    step = a.gpu_id_step
    for dp in range(a.dp_size):
        base = a.base_gpu_id + dp * a.tp_size * a.pp_size * step
        ranks += node_ranks(a, a.node_rank, dp, base_gpu_id=base, gpu_id_step=step)
    return tuple(ranks)


def reindexed(gpu_id: int, env: Mapping[str, str]) -> tuple[int, dict[str, str]]:
    """What ``maybe_reindex_device_id`` hands a CUDA spawn: id 0, seeing only the
    ``gpu_id``-th entry of ``CUDA_VISIBLE_DEVICES`` (the id, if that is unset/empty).
    Past the list's end, where upstream raises, the spawn is left as it was, for
    ``place_gpu_id`` to name the setting."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    entries = visible.split(",") if visible else []
    if gpu_id >= len(entries) > 0:
        return gpu_id, dict(env)
    physical = entries[gpu_id] if entries else str(gpu_id)
    return 0, {**env, "CUDA_VISIBLE_DEVICES": physical}


def check_gpus(
    text: str, *, topology: HostTopology, gpu_ids: Sequence[int]
) -> tuple[str, ...]:
    """``--gpus`` parsed and checked against the host and the ranks' GPU ids: a typo
    or a missing address is a bad setting, never a rank left unbound."""
    parts, flag = text.split(","), f"--gpus={shown(text)}"
    if len(parts) > MAX_GPU_ID + 1 or not all(part.strip() for part in parts):
        raise UsageError(
            f"{flag} is not valid: give up to {MAX_GPU_ID + 1} PCI addresses "
            f"separated by commas, {_GPUS_EXAMPLE}"
        )
    found: list[str] = []
    for position, part in enumerate(parts):
        address = canonical_pci_address(part)
        if address is None:
            raise UsageError(
                f"{flag}: entry {position} ({shown(part.strip())}) is not a PCI "
                f"address; expected dddd:bb:dd.f or bb:dd.f, {_GPUS_EXAMPLE}"
            )
        if address in found:
            raise UsageError(
                f"{flag}: {address} is listed twice (entries {found.index(address)} "
                f"and {position}); each device index needs its own GPU, {_GPUS_EXAMPLE}"
            )
        if topology.pci_device(address) is None:
            raise UsageError(
                f"--gpus: {address} (device index {position}) is not among the "
                f"{len(topology.pci_devices)} PCI devices read from {topology.root}; "
                f"check it with `lspci -D`, {_GPUS_EXAMPLE}"
            )
        found.append(address)
    top = max(gpu_ids, default=-1)
    if top >= len(found):
        raise UsageError(
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


def plan_engine(
    server_args: PlanArgs,
    *,
    launcher: Launcher = Launcher.MP,
    host: Optional[FactsHost] = None,
) -> tuple[ProcessPlacement, ...]:
    """Every rank this host runs, each placed as sglang's spawn (or Ray actor) of its
    GPU id will place it: on this host through ``numa_utils`` itself, else on
    ``host``. Nothing is bound and no failure policy runs."""
    ranks = local_ranks(server_args)
    if host is None:
        from sglang.srt.utils import numa_utils

        def place(rank: RankIdentity, gpu: DeviceRef) -> ProcessPlacement:
            return numa_utils.place_gpu_id(
                server_args, gpu, launcher=launcher, rank=rank, report_failures=False
            )

    else:
        policy = PlacementPolicy.from_env(server_args, launcher=launcher)

        def place(
            rank: RankIdentity, gpu: DeviceRef, seen: FactsHost = host
        ) -> ProcessPlacement:
            rank = replace(rank, device=gpu)
            return resolve_placement(rank=rank, policy=policy, host=seen)

    # maybe_reindex_device_id spawns each CUDA rank under one visible GPU, as GPU 0.
    mp_cuda = server_args.device == "cuda" and Launcher(launcher) is Launcher.MP
    reindex = mp_cuda and envs.SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS.get()
    if launcher == Launcher.RAY:  # Ray's id names a physical GPU
        physical = DeviceIndex.PHYSICAL_GPU
        ranks = tuple(
            (
                replace(r, device=DeviceRef(physical, r.device.index))
                if r.device.numbering is DeviceIndex.LOGICAL_GPU
                else r
            )
            for r in ranks
        )
    if not reindex:
        return tuple(place(rank, rank.device) for rank in ranks)
    return tuple(_reindexed_placement(rank, place, host) for rank in ranks)


def _reindexed_placement(
    rank: RankIdentity, place, host: Optional[FactsHost]
) -> ProcessPlacement:
    env = settings.device_env() if host is None else host.env
    gpu_id, spawned = reindexed(rank.device.index, env)
    spawn = DeviceRef(DeviceIndex.LOGICAL_GPU, gpu_id)
    if host is None:
        with _environ(spawned):
            placement = place(rank, spawn)
    else:
        placement = place(rank, spawn, host.with_env(spawned))
    placement = replace(placement, rank=rank)
    if gpu_id != 0:
        return placement
    visible = f"CUDA_VISIBLE_DEVICES={spawned['CUDA_VISIBLE_DEVICES']}"
    why = f"{rank.device.label} is spawned as GPU 0 with {visible}"
    note = f"SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS=1: {why}"
    return replace(placement, reasons=(note, *placement.reasons))


@contextlib.contextmanager
def _environ(env: Mapping[str, str]) -> Iterator[None]:
    """The visibility variables of ``env`` in force for the block, as the spawn sees
    them (``place_gpu_id`` reads the live process's)."""
    saved = {name: os.environ.get(name) for name in settings.DEVICE_VARS}
    os.environ.update({k: v for k, v in env.items() if k in settings.DEVICE_VARS})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def describe(p: ProcessPlacement) -> str:
    device = p.rank.device
    gpu = "" if device is None else f" {device.label}"
    head = f"[{p.label}]{gpu}{f' ({p.pci})' if p.pci else ''}:"
    return f"{head} {p.summary}"


def to_dict(p: ProcessPlacement) -> dict[str, object]:
    data = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)[1:]}
    device = p.rank.device
    data.update(
        cpus=format_cpulist(p.cpus),
        mem_nodes=format_cpulist(p.mem_nodes),
        mem_policy=p.mem_policy.value,
        strategy=p.strategy.value,
        launcher=str(p.launcher),
        reasons=list(p.reasons),
        numactl_args=list(p.numactl_args),
    )
    ranks = {key: getattr(p.rank, key) for key in ("dp_rank", "pp_rank", "tp_rank")}
    ranks["gpu_id"] = device.index if device else None
    ranks["numbering"] = device.numbering.value if device else None
    return {**ranks, **data}


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
    device = None
    if data["gpu_id"] is not None:
        device = DeviceRef(DeviceIndex(data["numbering"]), data["gpu_id"])
    ranks = (data[key] for key in ("dp_rank", "pp_rank", "tp_rank"))
    return ProcessPlacement(rank=RankIdentity(device, *ranks), **given)
