"""The placement of the rank a GPU id names, and of every rank of a host.

sglang spawns each scheduler inside ``configure_subprocess(server_args, gpu_id)``;
``place_gpu_id`` answers for that id, identifying its device under the visibility
variable in force, and ``plan_engine`` asks it for every local rank, so it shows what
the spawns do. A device that cannot be identified leaves its rank unbound, with why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import TYPE_CHECKING, Iterator, Mapping, Optional, Sequence, Union

from sglang.srt.placement import settings
from sglang.srt.placement.cpu_groups import rank_cpus, shared_cpus
from sglang.srt.placement.policy import PlacementPolicy
from sglang.srt.placement.ranks import local_ranks, reindexed
from sglang.srt.placement.resolve import (  # noqa: F401  (HostFacts: importers')
    HostFacts,
    choose_node,
    not_placed,
    resolve_placement,
)
from sglang.srt.placement.types import (
    Accelerator,
    HostTopology,
    ProcessPlacement,
    RankIdentity,
)

if TYPE_CHECKING:
    from sglang.srt.placement.devices import AcceleratorRuntime
    from sglang.srt.server_args import ServerArgs

LIVE_RUNTIME = "live"
"""Open NVML when planning this host's own /sys; nothing for a snapshot or --gpus."""

Runtime = Union["AcceleratorRuntime", str, None]


@contextlib.contextmanager
def _opened(
    runtime: Runtime,
    *,
    device: str,
    topology: HostTopology,
    gpus: Optional[Sequence[str]],
) -> Iterator[Optional["AcceleratorRuntime"]]:
    """The runtime to identify devices with; NVML is shut down afterwards, as
    upstream does."""
    if runtime != LIVE_RUNTIME:
        yield runtime
        return
    opened = None
    if device == "cuda" and gpus is None and os.path.realpath(topology.root) == "/sys":
        from sglang.srt.placement.devices import default_runtime

        opened = default_runtime(device)
    try:
        yield opened
    finally:
        if opened is not None:
            opened.close()


def _identify(
    gpu_id: int,
    *,
    device: str,
    topology: HostTopology,
    env: Mapping[str, str],
    gpus: Optional[Sequence[str]],
    runtime: Optional["AcceleratorRuntime"],
) -> tuple[Optional[Accelerator], str]:
    """The device behind ``gpu_id``, or None and why it was not found."""
    from sglang.srt.placement.devices import DeviceIdentityError, identify_accelerators

    try:
        (found,) = identify_accelerators(
            device=device,
            topology=topology,
            env=env,
            gpu_ids=[gpu_id],
            gpus=gpus,
            runtime=runtime,
        )
    except DeviceIdentityError as exc:
        return None, str(exc)
    return dataclasses.replace(found, gpu_id=gpu_id), ""


def device_node(
    gpu_id: int,
    *,
    device: str,
    topology: HostTopology,
    env: Mapping[str, str],
    runtime: Runtime = LIVE_RUNTIME,
) -> tuple[Optional[int], str]:
    """The NUMA node of logical device ``gpu_id`` under ``env``, or None, and why."""
    with _opened(runtime, device=device, topology=topology, gpus=None) as opened:
        accelerator, problem = _identify(
            gpu_id, device=device, topology=topology, env=env, gpus=None, runtime=opened
        )
    if accelerator is None:
        return None, problem
    choice = choose_node(
        topology=topology,
        rank=RankIdentity(0, 0, 0, gpu_id),
        accelerator=accelerator,
        policy=PlacementPolicy(launcher="mp", device=device),
    )
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
    ask = dict(facts=facts, rank=rank, policy=policy)
    if policy.device == "cpu":
        cpus = rank_cpus(
            policy.cpu_threads_bind,
            index=gpu_id,
            topology=facts.topology,
            affinity=facts.affinity,
        )
        placement = resolve_placement(**ask, accelerator=None, cpu_rank_set=cpus)
        note = shared_cpus(policy.cpu_threads_bind, index=gpu_id)
        return _noted(placement, note)
    reason = not_placed(policy, facts.topology)
    if reason is not None:
        return ProcessPlacement.unbound(
            rank, reasons=[reason], launcher=policy.launcher, failure=False
        )
    with _opened(
        runtime, device=policy.device, topology=facts.topology, gpus=gpus
    ) as opened:
        accelerator, problem = _identify(
            gpu_id,
            device=policy.device,
            topology=facts.topology,
            env=env,
            gpus=gpus,
            runtime=opened,
        )
    if accelerator is None and policy.numa_nodes is None:
        return ProcessPlacement.unbound(
            rank,
            reasons=[f"GPU {gpu_id} cannot be identified: {problem}"],
            launcher=policy.launcher,
            failure=True,
        )
    return resolve_placement(**ask, accelerator=accelerator)


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
    affinity_mode: Optional[str] = None,
    policy: Optional[PlacementPolicy] = None,
) -> tuple[ProcessPlacement, ...]:
    """Every rank this host runs, each placed as sglang's spawn of its GPU id will be,
    under ``env``, the launcher's environment (default: this process's)."""
    facts = facts if facts is not None else HostFacts.live()
    policy = policy or PlacementPolicy.from_env(
        server_args, launcher=launcher, affinity_mode=affinity_mode
    )
    env = dict(os.environ if env is None else env)
    # SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS=1: maybe_reindex_device_id spawns a CUDA
    # rank under one visible GPU, as GPU 0.
    reindex = (
        gpus is None
        and policy.device == "cuda"
        and policy.launcher == "mp"
        and settings.one_visible_device_per_process()
    )
    placements = []
    with _opened(
        runtime, device=policy.device, topology=facts.topology, gpus=gpus
    ) as opened:
        for rank in local_ranks(server_args):
            gpu_id, spawned_env, note = rank.gpu_id, env, None
            if reindex:
                gpu_id, spawned_env = reindexed(rank.gpu_id, env)
                note = (
                    "SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS=1: GPU "
                    f"{rank.gpu_id} is spawned as GPU {gpu_id} with "
                    f"CUDA_VISIBLE_DEVICES={spawned_env['CUDA_VISIBLE_DEVICES']}"
                )
            placement = place_gpu_id(
                server_args,
                gpu_id,
                policy=policy,
                facts=facts,
                env=spawned_env,
                gpus=gpus,
                runtime=opened,
                rank=rank,
            )
            placements.append(_noted(placement, note))
    return tuple(placements)
