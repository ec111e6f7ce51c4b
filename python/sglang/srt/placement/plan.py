"""The placement of the rank a GPU id names, and of every rank of a host or a Ray node.

sglang spawns each scheduler inside ``configure_subprocess(server_args,
gpu_id)``; ``place_gpu_id`` answers for exactly that id, identifying only its
device under the ``CUDA_VISIBLE_DEVICES`` (or ``ZE_AFFINITY_MASK``) in force.
No mode looks at the other ranks (``exclusive`` and ``core-complex`` share a
node out by the GPUs sysfs shows on it), so ``plan_engine``, which asks the
same question for every local rank, shows what the spawns do, and
``plan_node``, which answers from the ids Ray gives a node's ranks, agrees
with both for the same GPU. A device that cannot be identified leaves its
rank unbound with the reason; nothing here raises for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional, Sequence, Union

from sglang.srt.placement import settings
from sglang.srt.placement.cpu_groups import rank_cpus, shared_cpus
from sglang.srt.placement.policy import PlacementPolicy
from sglang.srt.placement.ranks import (
    ONE_VISIBLE_DEVICE_VAR,
    local_ranks,
    rank_of_gpu_id,
    reindexed,
)
from sglang.srt.placement.resolve import ONE_NODE_REASON, choose_node, resolve_placement
from sglang.srt.placement.strategy import HostCapabilities
from sglang.srt.placement.types import (
    Accelerator,
    HostTopology,
    ProcessAffinity,
    ProcessPlacement,
    RankIdentity,
)

if TYPE_CHECKING:
    from sglang.srt.placement.devices import AcceleratorRuntime
    from sglang.srt.server_args import ServerArgs

_ACCELERATOR_DEVICES = ("cuda", "xpu")

LIVE_RUNTIME = "live"
"""The default runtime: NVML when planning this host's own /sys, nothing for a snapshot."""

Runtime = Union["AcceleratorRuntime", str, None]
"""An opened runtime, ``LIVE_RUNTIME`` to open NVML here, or None for sysfs order."""


@dataclass(frozen=True)
class HostFacts:
    """What placement asks of a host: its topology, this process's affinity, what can apply a binding."""

    topology: HostTopology
    affinity: ProcessAffinity
    capabilities: HostCapabilities

    @classmethod
    def live(cls) -> "HostFacts":
        """This host, its topology read from ``SGLANG_SYSFS_ROOT``."""
        from sglang.srt.placement.topology import (
            read_process_affinity,
            read_topology_cached,
        )

        return cls(
            topology=read_topology_cached(settings.sysfs_root()),
            affinity=read_process_affinity(),
            capabilities=HostCapabilities.live(),
        )


@contextlib.contextmanager
def _opened(
    runtime: Runtime,
    *,
    device: str,
    topology: HostTopology,
    gpus: Optional[Sequence[str]],
) -> Iterator[Optional["AcceleratorRuntime"]]:
    """The runtime to identify devices with. ``LIVE_RUNTIME`` opens NVML for this
    host's own /sys (and shuts it down afterwards, as upstream does); a snapshot or
    ``--gpus`` needs none.
    """
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
    policy: PlacementPolicy,
    topology: HostTopology,
    env: Mapping[str, str],
    gpus: Optional[Sequence[str]],
    runtime: Optional["AcceleratorRuntime"],
    ray_id: Optional[str] = None,
) -> tuple[Optional[Accelerator], Optional[str]]:
    """The device behind ``gpu_id`` (or Ray's id ``ray_id``) and None, or None and why it was not found."""
    from sglang.srt.placement.devices import DeviceIdentityError, identify_accelerators

    ask: dict[str, Any] = dict(gpu_ids=[gpu_id], gpus=gpus, runtime=runtime)
    if ray_id is not None and gpus is not None:
        # --gpus lists PCI addresses by physical device index, as an index id names.
        if not ray_id.isdigit():
            return None, (
                f"--gpus lists devices by index, but Ray's id for GPU {gpu_id} is "
                f"{ray_id!r}"
            )
        ask.update(gpu_ids=[int(ray_id)])
    elif ray_id is not None:
        ask.update(gpu_ids=[0], ray_accelerator_ids=[ray_id])
    try:
        (found,) = identify_accelerators(
            device=policy.device, topology=topology, env=env, **ask
        )
    except DeviceIdentityError as exc:
        return None, str(exc)
    physical = ray_id if ray_id is not None else found.physical_id
    return dataclasses.replace(found, gpu_id=gpu_id, physical_id=physical), None


def device_node(
    gpu_id: int,
    *,
    device: str,
    topology: HostTopology,
    env: Mapping[str, str],
    runtime: Runtime = LIVE_RUNTIME,
) -> tuple[Optional[int], str]:
    """The NUMA node of the device behind logical index ``gpu_id`` under ``env``, or None, and why."""
    policy = PlacementPolicy(launcher="mp", device=device)
    with _opened(runtime, device=device, topology=topology, gpus=None) as opened:
        accelerator, problem = _identify(
            gpu_id, policy=policy, topology=topology, env=env, gpus=None, runtime=opened
        )
    if accelerator is None:
        return None, problem or "not identified"
    rank = RankIdentity(dp_rank=0, pp_rank=0, tp_rank=0, gpu_id=gpu_id)
    choice = choose_node(
        topology=topology, rank=rank, accelerator=accelerator, policy=policy
    )
    return choice.node, "; ".join(choice.reasons)


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
    """Where the scheduler sglang spawns with ``gpu_id`` runs, under the environment ``env`` it inherits.

    ``rank`` labels the placement (default: the local rank that sglang's
    arithmetic gives ``gpu_id``). For the CPU device ``gpu_id`` is the rank's
    ``numa_index``, as bootstrap uses it.
    """
    rank = dataclasses.replace(
        rank
        or rank_of_gpu_id(server_args, gpu_id)
        or RankIdentity(dp_rank=0, pp_rank=0, tp_rank=0, gpu_id=gpu_id),
        gpu_id=gpu_id,
    )
    topology, affinity = facts.topology, facts.affinity
    if policy.device == "cpu":
        placement = resolve_placement(
            topology=topology,
            affinity=affinity,
            rank=rank,
            accelerator=None,
            policy=policy,
            capabilities=facts.capabilities,
            cpu_rank_set=rank_cpus(
                policy.cpu_threads_bind,
                index=gpu_id,
                topology=topology,
                affinity=affinity,
            ),
        )
        note = shared_cpus(policy.cpu_threads_bind, index=gpu_id)
        return (
            placement.replace(reasons=(note, *placement.reasons)) if note else placement
        )
    # sglang's own preconditions, checked before any device is asked about.
    not_placed = None
    if policy.device not in _ACCELERATOR_DEVICES:
        not_placed = (
            f"device {policy.device!r}: sglang places only cuda, xpu and cpu ranks"
        )
    elif policy.numa_nodes is None and not policy.auto_numa_bind:
        not_placed = "no --numa-node and SGLANG_AUTO_NUMA_BIND=0: not binding"
    elif (
        policy.numa_nodes is None
        and policy.affinity_mode == "node"
        and len(topology.cpu_nodes) < 2
    ):
        not_placed = ONE_NODE_REASON
    if not_placed is not None:
        return ProcessPlacement.unbound(
            rank, reasons=[not_placed], launcher=policy.launcher, failure=False
        )
    with _opened(runtime, device=policy.device, topology=topology, gpus=gpus) as opened:
        accelerator, problem = _identify(
            gpu_id, policy=policy, topology=topology, env=env, gpus=gpus, runtime=opened
        )
    if accelerator is None and policy.numa_nodes is None:
        return ProcessPlacement.unbound(
            rank,
            reasons=[f"GPU {gpu_id} cannot be identified: {problem}"],
            launcher=policy.launcher,
            failure=True,
        )
    return resolve_placement(
        topology=topology,
        affinity=affinity,
        rank=rank,
        accelerator=accelerator,
        policy=policy,
        capabilities=facts.capabilities,
    )


def spawn_environment(
    policy: PlacementPolicy, gpu_id: int, env: Mapping[str, str]
) -> tuple[int, dict[str, str], str]:
    """The id and environment sglang's spawn of ``gpu_id`` sees, and a reason when they differ from the engine's.

    With ``SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS=1`` a CUDA rank is spawned under
    one visible GPU, as GPU 0 (``maybe_reindex_device_id``).
    """
    if (
        policy.device != "cuda"
        or policy.launcher != "mp"
        or not settings.one_visible_device_per_process()
    ):
        return gpu_id, dict(env), ""
    spawned_id, spawned_env = reindexed(gpu_id, env)
    visible = spawned_env["CUDA_VISIBLE_DEVICES"]
    why = (
        f"GPU {gpu_id} is spawned as GPU {spawned_id} with "
        f"CUDA_VISIBLE_DEVICES={visible}"
    )
    return spawned_id, spawned_env, f"{ONE_VISIBLE_DEVICE_VAR}=1: {why}"


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
    """Every rank this host runs (``ranks.local_ranks``), each placed as sglang's spawn of its GPU id will be.

    ``env`` is the environment the launcher runs with (default: this process's).
    """
    facts = facts if facts is not None else HostFacts.live()
    policy = policy or PlacementPolicy.from_env(
        server_args, launcher=launcher, affinity_mode=affinity_mode
    )
    env = dict(os.environ if env is None else env)
    placements = []
    with _opened(
        runtime, device=policy.device, topology=facts.topology, gpus=gpus
    ) as opened:
        for rank in local_ranks(server_args):
            gpu_id, spawned_env, note = (
                (rank.gpu_id, env, "")
                if gpus is not None
                else spawn_environment(policy, rank.gpu_id, env)
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
            if note:
                placement = placement.replace(reasons=(note, *placement.reasons))
            placements.append(placement)
    return tuple(placements)


def plan_node(
    server_args: "ServerArgs",
    *,
    ranks_with_ids: Sequence[tuple[RankIdentity, Optional[str]]],
    launcher: str = "ray",
    policy: Optional[PlacementPolicy] = None,
    facts: Optional[HostFacts] = None,
    gpus: Optional[Sequence[str]] = None,
    runtime: Runtime = LIVE_RUNTIME,
    affinity_mode: Optional[str] = None,
) -> tuple[ProcessPlacement, ...]:
    """One placement per (rank, accelerator id) pair of one Ray node, each resolved alone, there.

    Each id is the physical device Ray gives the rank (an index or a UUID),
    never read from the calling task's ``CUDA_VISIBLE_DEVICES``: that task
    holds no GPU. A rank may come with several candidate ids (Ray picks among
    a bundle's GPUs only when the actor starts): each pair gets its own
    placement. CPU ranks are placed by their id (``numa_index``), as
    ``place_gpu_id`` places them.
    """
    facts = facts if facts is not None else HostFacts.live()
    policy = policy or PlacementPolicy.from_env(
        server_args, launcher=launcher, affinity_mode=affinity_mode
    )
    topology = facts.topology
    if policy.device == "cpu":
        return tuple(
            place_gpu_id(
                server_args, rank.gpu_id, policy=policy, facts=facts, env={}, rank=rank
            )
            for rank, _ in ranks_with_ids
        )
    found: list[tuple[RankIdentity, Optional[Accelerator], Optional[str]]] = []
    with _opened(runtime, device=policy.device, topology=topology, gpus=gpus) as opened:
        for rank, accelerator_id in ranks_with_ids:
            text = str(accelerator_id).strip() if accelerator_id is not None else ""
            if not text:
                problem = (
                    f"{rank.label}: Ray gave no GPU id for a --device {policy.device} "
                    "rank (its bundle must hold one GPU: {'GPU': 1})"
                )
                found.append((rank, None, problem))
                continue
            found.append(
                (
                    rank,
                    *_identify(
                        rank.gpu_id,
                        policy=policy,
                        topology=topology,
                        env={},
                        gpus=gpus,
                        runtime=opened,
                        ray_id=text,
                    ),
                )
            )
    return tuple(
        (
            ProcessPlacement.unbound(
                rank,
                reasons=[problem or "no device"],
                launcher=policy.launcher,
                failure=True,
            )
            if accelerator is None
            else resolve_placement(
                topology=topology,
                affinity=facts.affinity,
                rank=rank,
                accelerator=accelerator,
                policy=policy,
                capabilities=facts.capabilities,
            )
        )
        for rank, accelerator, problem in found
    )
