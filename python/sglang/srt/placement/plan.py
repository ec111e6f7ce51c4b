"""The placement of the rank a GPU id names, and of every rank of a host or a Ray node.

sglang spawns each scheduler inside ``configure_subprocess(server_args,
gpu_id)``; ``place_gpu_id`` answers for exactly that id, identifying only its
device under the ``CUDA_VISIBLE_DEVICES`` (or ``ZE_AFFINITY_MASK``) in force.
Only ``exclusive`` mode looks at the node's other ranks, through sglang's own
rank arithmetic (``placement.ranks``). ``plan_engine`` asks the same question
for every local rank, the way sglang's launchers will, so ``plan`` shows what
the spawns do; ``plan_node`` answers for a Ray node's ranks from the ids Ray
gives them. A device that cannot be identified leaves its rank unbound with
the reason; nothing here raises for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Hashable, Iterator, Mapping, Optional, Sequence

from sglang.srt.placement import settings
from sglang.srt.placement.cpu_groups import rank_cpus, shared_cpus
from sglang.srt.placement.policy import PlacementPolicy
from sglang.srt.placement.ranks import (
    ONE_VISIBLE_DEVICE_VAR,
    local_ranks,
    rank_of_gpu_id,
    reindexed,
)
from sglang.srt.placement.resolve import choose_node, resolve_placement
from sglang.srt.placement.strategy import HostCapabilities
from sglang.srt.placement.types import (
    Accelerator,
    HostTopology,
    ProcessAffinity,
    ProcessPlacement,
    RankIdentity,
)

_ACCELERATOR_DEVICES = ("cuda", "xpu")

LIVE_RUNTIME = "live"
"""The default runtime: NVML when planning this host's own /sys, nothing for a snapshot."""


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
    runtime: Any, *, device: str, topology: HostTopology, gpus: Optional[Sequence[str]]
) -> Iterator[Any]:
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
    runtime: Any,
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


def _exclusive_slices(
    found: Sequence[tuple[RankIdentity, Optional[Accelerator]]],
    *,
    topology: HostTopology,
    policy: PlacementPolicy,
) -> dict[Hashable, tuple[int, int]]:
    """(index, count) of each device among the distinct devices of its node, in the
    order given."""
    by_node: dict[int, list[Hashable]] = {}
    for rank, accelerator in found:
        if accelerator is None:
            continue
        node = choose_node(
            topology=topology, rank=rank, accelerator=accelerator, policy=policy
        ).node
        key = accelerator.pci or accelerator.physical_id
        if node is not None and key not in by_node.setdefault(node, []):
            by_node[node].append(key)
    return {
        key: (index, len(members))
        for members in by_node.values()
        for index, key in enumerate(members)
    }


def _unbound(
    rank: RankIdentity,
    policy: PlacementPolicy,
    reasons: Sequence[str],
    *,
    failure: bool,
) -> ProcessPlacement:
    return ProcessPlacement.unbound(
        rank, reasons=reasons, launcher=policy.launcher, failure=failure
    )


def device_node(
    gpu_id: int,
    *,
    device: str,
    topology: HostTopology,
    env: Mapping[str, str],
    runtime: Any = LIVE_RUNTIME,
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


def _exclusive_slice(
    server_args: Any,
    target: Accelerator,
    *,
    policy: PlacementPolicy,
    topology: HostTopology,
    env: Mapping[str, str],
    gpus: Optional[Sequence[str]],
    runtime: Any,
) -> tuple[Optional[tuple[int, int]], Optional[str]]:
    """(index, count) of ``target``'s slice among the devices of the local ranks on its node, or None and why.

    The other ranks come from sglang's arithmetic and are identified under the
    same environment; when one cannot be (a narrowed ``CUDA_VISIBLE_DEVICES``),
    the slices cannot be agreed and the rank binds to its whole node instead.
    """
    found: list[tuple[RankIdentity, Optional[Accelerator]]] = []
    for other in local_ranks(server_args):
        accelerator, problem = (
            (target, None)
            if other.gpu_id == target.gpu_id
            else _identify(
                other.gpu_id,
                policy=policy,
                topology=topology,
                env=env,
                gpus=gpus,
                runtime=runtime,
            )
        )
        if accelerator is None:
            return None, (
                f"exclusive mode needs the device of every local rank, but GPU "
                f"{other.gpu_id} cannot be identified here ({problem}): binding to the "
                "whole node instead"
            )
        found.append((other, accelerator))
    slices = _exclusive_slices(found, topology=topology, policy=policy)
    return slices.get(target.pci or target.physical_id), None


def place_gpu_id(
    server_args: Any,
    gpu_id: int,
    *,
    policy: PlacementPolicy,
    facts: HostFacts,
    env: Mapping[str, str],
    gpus: Optional[Sequence[str]] = None,
    runtime: Any = LIVE_RUNTIME,
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
        not_placed = (
            "this host has one NUMA node with CPUs: node binding cannot help "
            "(exclusive mode still splits it between ranks)"
        )
    if not_placed is not None:
        return _unbound(rank, policy, [not_placed], failure=False)
    with _opened(runtime, device=policy.device, topology=topology, gpus=gpus) as opened:
        accelerator, problem = _identify(
            gpu_id, policy=policy, topology=topology, env=env, gpus=gpus, runtime=opened
        )
        if accelerator is None and policy.numa_nodes is None:
            why = f"GPU {gpu_id} cannot be identified: {problem}"
            return _unbound(rank, policy, [why], failure=True)
        exclusive, degraded = None, None
        if policy.affinity_mode == "exclusive" and accelerator is not None:
            exclusive, degraded = _exclusive_slice(
                server_args,
                accelerator,
                policy=policy,
                topology=topology,
                env=env,
                gpus=gpus,
                runtime=opened,
            )
    placement = resolve_placement(
        topology=topology,
        affinity=affinity,
        rank=rank,
        accelerator=accelerator,
        policy=policy,
        capabilities=facts.capabilities,
        exclusive_slice=exclusive,
    )
    if degraded is not None and placement.bound:
        placement = placement.replace(
            reasons=(*placement.reasons, degraded), warning=True
        )
    return placement


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
    server_args: Any,
    *,
    launcher: str = "mp",
    facts: Optional[HostFacts] = None,
    env: Optional[Mapping[str, str]] = None,
    gpus: Optional[Sequence[str]] = None,
    runtime: Any = LIVE_RUNTIME,
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
    server_args: Any,
    *,
    ranks_with_ids: Sequence[tuple[RankIdentity, Optional[str]]],
    launcher: str = "ray",
    policy: Optional[PlacementPolicy] = None,
    facts: Optional[HostFacts] = None,
    gpus: Optional[Sequence[str]] = None,
    runtime: Any = LIVE_RUNTIME,
    affinity_mode: Optional[str] = None,
) -> tuple[ProcessPlacement, ...]:
    """One placement per (rank, accelerator id) pair, all of one Ray node's ranks resolved together, there.

    Each id is the physical device Ray gives the rank (an index or a UUID),
    never read from the calling task's ``CUDA_VISIBLE_DEVICES``: that task
    holds no GPU. A rank may come with several candidate ids (Ray picks among
    a bundle's GPUs only when the actor starts): each pair gets its own
    placement, and they share ``exclusive`` slices by device. CPU ranks are
    placed by their id (``numa_index``), as ``place_gpu_id`` places them.
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
    slices = (
        _exclusive_slices(
            [(rank, accelerator) for rank, accelerator, _ in found],
            topology=topology,
            policy=policy,
        )
        if policy.affinity_mode == "exclusive"
        else {}
    )
    return tuple(
        (
            _unbound(rank, policy, [problem or "no device"], failure=True)
            if accelerator is None
            else resolve_placement(
                topology=topology,
                affinity=facts.affinity,
                rank=rank,
                accelerator=accelerator,
                policy=policy,
                capabilities=facts.capabilities,
                exclusive_slice=slices.get(accelerator.pci or accelerator.physical_id),
            )
        )
        for rank, accelerator, problem in found
    )
