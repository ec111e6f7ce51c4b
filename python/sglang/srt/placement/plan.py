"""sglang spawns each scheduler inside ``configure_subprocess(server_args, gpu_id)``:
``place_gpu_id`` places that id, under the visibility variable in force, and
``plan_engine`` asks it for every local rank, so it shows what the spawns do."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import TYPE_CHECKING, Mapping, Optional, Sequence, Union

from sglang.srt.placement import settings
from sglang.srt.placement.cpu_groups import rank_cpus, shared_cpus
from sglang.srt.placement.devices import (
    AcceleratorRuntime,
    default_runtime,
    identify_accelerators,
)
from sglang.srt.placement.policy import PlacementPolicy
from sglang.srt.placement.ranks import local_ranks, reindexed
from sglang.srt.placement.resolve import HostFacts, choose_node, resolve_placement
from sglang.srt.placement.types import (
    Accelerator,
    HostTopology,
    ProcessPlacement,
    RankIdentity,
)

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

LIVE_RUNTIME = "live"  # NVML for this host's own /sys; nothing for a snapshot or --gpus
Runtime = Union[AcceleratorRuntime, str, None]


def _opened(
    runtime: Runtime, device: str, topology: HostTopology, gpus: Optional[Sequence[str]]
) -> contextlib.AbstractContextManager:
    # NVML is shut down after, as upstream does.
    if runtime != LIVE_RUNTIME:
        return contextlib.nullcontext(runtime)
    if device == "cuda" and gpus is None and os.path.realpath(topology.root) == "/sys":
        opened = default_runtime(device)
        if opened is not None:
            return contextlib.closing(opened)
    return contextlib.nullcontext(None)


def _identify(
    gpu_id: int,
    *,
    device: str,
    topology: HostTopology,
    env: Mapping[str, str],
    gpus: Optional[Sequence[str]] = None,
    runtime: Runtime = LIVE_RUNTIME,
) -> tuple[Optional[Accelerator], str]:
    with _opened(runtime, device, topology, gpus) as opened:
        try:
            (found,) = identify_accelerators(
                device=device,
                topology=topology,
                env=env,
                gpu_ids=[gpu_id],
                gpus=gpus,
                runtime=opened,
            )
        except settings.SettingError as exc:
            return None, str(exc)
    return found, ""


def device_node(
    gpu_id: int, *, device: str, topology: HostTopology, env: Mapping[str, str]
) -> tuple[Optional[int], str]:
    found, problem = _identify(gpu_id, device=device, topology=topology, env=env)
    if found is None:
        return None, problem
    policy = PlacementPolicy(launcher="mp", device=device)
    choice = choose_node(topology, RankIdentity(0, 0, 0, gpu_id), found, policy)
    return choice.value, "; ".join(choice.reasons)


def place_gpu_id(
    server_args: "ServerArgs",
    gpu_id: int,
    *,
    policy: PlacementPolicy,
    facts: HostFacts,
    env: Mapping[str, str],
    gpus: Optional[Sequence[str]] = None,
    runtime: Runtime = LIVE_RUNTIME,
    rank: Optional[RankIdentity] = None,
) -> ProcessPlacement:
    """Where the scheduler sglang spawns with ``gpu_id`` runs, under the ``env`` it
    inherits. ``rank`` labels it (default: the local rank sglang's arithmetic gives
    ``gpu_id``); for the CPU device ``gpu_id`` is the rank's ``numa_index``."""
    if rank is None:
        ranks = [r for r in local_ranks(server_args) if r.gpu_id == gpu_id]
        rank = ranks[0] if ranks else RankIdentity(0, 0, 0, gpu_id)
    rank = dataclasses.replace(rank, gpu_id=gpu_id)
    resolve = functools.partial(
        resolve_placement, facts=facts, rank=rank, policy=policy
    )
    topology, spec = facts.topology, policy.cpu_threads_bind
    if policy.device == "cpu":
        cpus = rank_cpus(spec, index=gpu_id, topology=topology, affinity=facts.affinity)
        placement = resolve(accelerator=None, cpu_rank_set=cpus)
        return _noted(placement, shared_cpus(spec, index=gpu_id))
    unbound = functools.partial(
        ProcessPlacement.unbound, rank, launcher=policy.launcher
    )
    # Why sglang leaves an accelerator rank unbound whatever its device, decided
    # before any device is asked about.
    why, listed = None, policy.numa_nodes is not None
    if policy.device not in ("cuda", "xpu"):
        why = f"device {policy.device!r}: sglang places only cuda, xpu and cpu ranks"
    elif not listed and not policy.auto_numa_bind:
        why = "no --numa-node and SGLANG_AUTO_NUMA_BIND=0: not binding"
    elif not listed and policy.affinity_mode == "node" and len(topology.cpu_nodes) < 2:
        why = (
            "this host has one NUMA node with CPUs: node binding cannot help "
            "(exclusive and core-complex modes still share it out between its GPUs)"
        )
    if why is not None:
        return unbound(reasons=[why], failure=False)
    found, problem = _identify(
        gpu_id,
        device=policy.device,
        topology=topology,
        env=env,
        gpus=gpus,
        runtime=runtime,
    )
    if found is None and policy.numa_nodes is None:
        why = f"GPU {gpu_id} cannot be identified: {problem}"
        return unbound(reasons=[why], failure=True)
    return resolve(accelerator=found)


def _noted(placement: ProcessPlacement, note: Optional[str]) -> ProcessPlacement:
    if not note:
        return placement
    return dataclasses.replace(placement, reasons=(note, *placement.reasons))


def plan_engine(
    server_args: "ServerArgs",
    *,
    launcher: str = "mp",
    facts: Optional[HostFacts] = None,
    env: Optional[Mapping[str, str]] = None,
    gpus: Optional[Sequence[str]] = None,
    runtime: Runtime = LIVE_RUNTIME,
    policy: Optional[PlacementPolicy] = None,
) -> tuple[ProcessPlacement, ...]:
    """Every rank this host runs, each placed as sglang's spawn of its GPU id will be,
    under ``env``, the launcher's environment (default: this process's)."""
    facts = facts if facts is not None else HostFacts.live()
    policy = policy or PlacementPolicy.from_env(server_args, launcher=launcher)
    env = dict(os.environ if env is None else env)
    # maybe_reindex_device_id spawns each CUDA rank under one visible GPU, as GPU 0.
    reindex = (
        gpus is None
        and policy.device == "cuda"
        and policy.launcher == "mp"
        and settings.one_visible_device_per_process()
    )
    placements = []
    with _opened(runtime, policy.device, facts.topology, gpus) as opened:
        place = functools.partial(
            place_gpu_id, server_args, policy=policy, facts=facts, gpus=gpus
        )
        for rank in local_ranks(server_args):
            gpu_id, spawned_env, note = rank.gpu_id, env, None
            if reindex:
                gpu_id, spawned_env = reindexed(rank.gpu_id, env)
                note = (
                    f"SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS=1: GPU {rank.gpu_id} is "
                    f"spawned as GPU {gpu_id} with "
                    f"CUDA_VISIBLE_DEVICES={spawned_env['CUDA_VISIBLE_DEVICES']}"
                )
            placement = place(gpu_id, env=spawned_env, runtime=opened, rank=rank)
            placements.append(_noted(placement, note))
    return tuple(placements)
