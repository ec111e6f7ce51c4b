"""sglang spawns each scheduler inside ``configure_subprocess(server_args, gpu_id)``:
``place_gpu_id`` places that id, under the visibility variables in force."""

from __future__ import annotations

import dataclasses
from typing import Callable, ContextManager, Mapping, Optional

from sglang.srt.placement.cpu_groups import rank_cpus, shared_cpus
from sglang.srt.placement.devices import (
    AcceleratorRuntime,
    identify_accelerators,
    open_runtime,
)
from sglang.srt.placement.policy import PlacementPolicy
from sglang.srt.placement.resolve import (
    HostFacts,
    Where,
    choose_node,
    resolve_placement,
)
from sglang.srt.placement.types import (
    Accelerator,
    HostTopology,
    Launcher,
    ProcessPlacement,
    RankIdentity,
    SettingError,
)

# (device, topology) -> the runtime that maps physical devices to PCI addresses.
RuntimeOpener = Callable[
    [str, HostTopology], ContextManager[Optional[AcceleratorRuntime]]
]


def _identify(
    gpu_id: int,
    *,
    device: str,
    topology: HostTopology,
    env: Mapping[str, str],
    runtime: RuntimeOpener,
) -> Accelerator:
    with runtime(device, topology) as opened:
        found = identify_accelerators(
            device=device, topology=topology, env=env, gpu_ids=[gpu_id], runtime=opened
        )
    return found[0]


def device_node(
    gpu_id: int, *, device: str, topology: HostTopology, env: Mapping[str, str]
) -> Where:
    """Upstream's question: the node of ``gpu_id``'s device (None: no node, and why)."""
    ask = dict(device=device, topology=topology, env=env, runtime=open_runtime)
    try:
        found = _identify(gpu_id, **ask)
    except SettingError as exc:
        return Where(None, (str(exc),))
    policy = PlacementPolicy(launcher=Launcher.MP, device=device)
    return choose_node(topology, RankIdentity.of_gpu(gpu_id), found, policy)


def _why_unbound(policy: PlacementPolicy, topology: HostTopology) -> Optional[str]:
    """Why sglang leaves an accelerator rank unbound whatever its device."""
    listed = policy.numa_nodes is not None
    if policy.device not in ("cuda", "xpu"):
        return f"device {policy.device!r}: sglang places only cuda, xpu and cpu ranks"
    if not listed and not policy.auto_numa_bind:
        return "no --numa-node and SGLANG_AUTO_NUMA_BIND=0: not binding"
    if not listed and policy.affinity_mode.idle_on_one_node:
        if len(topology.cpu_nodes) < 2:
            return (
                "this host has one NUMA node with CPUs: node binding cannot help "
                "(exclusive and core-complex modes still share it out between its "
                "GPUs)"
            )
    return None


def place_gpu_id(
    gpu_id: int,
    *,
    policy: PlacementPolicy,
    facts: HostFacts,
    env: Mapping[str, str],
    rank: Optional[RankIdentity] = None,
    runtime: RuntimeOpener = open_runtime,
) -> ProcessPlacement:
    """Where the scheduler sglang spawns with ``gpu_id`` runs, under the ``env`` it
    inherits; for the CPU device ``gpu_id`` is the rank's ``numa_index``. ``runtime``
    opens what names physical devices (NVML on this host's own /sys)."""
    rank = dataclasses.replace(rank or RankIdentity.of_gpu(gpu_id), gpu_id=gpu_id)
    topology = facts.topology
    if policy.device == "cpu":
        spec = policy.cpu_threads_bind
        cpus = rank_cpus(spec, index=gpu_id, topology=topology, affinity=facts.affinity)
        placement = resolve_placement(
            facts=facts, rank=rank, accelerator=None, policy=policy, cpu_rank_set=cpus
        )
        note = shared_cpus(spec, index=gpu_id)
        return placement if not note else noted(placement, note)
    why = _why_unbound(policy, topology)
    if why is not None:
        return ProcessPlacement(rank, reasons=(why,), launcher=policy.launcher)
    ask = dict(device=policy.device, topology=topology, env=env, runtime=runtime)
    try:
        found = _identify(gpu_id, **ask)
    except SettingError as exc:
        if policy.numa_nodes is None:
            why = f"GPU {gpu_id} cannot be identified: {exc}"
            return ProcessPlacement(
                rank, reasons=(why,), launcher=policy.launcher, degraded=True
            )
        found = None  # the --numa-node list needs no device
    return resolve_placement(facts=facts, rank=rank, accelerator=found, policy=policy)


def noted(placement: ProcessPlacement, note: str) -> ProcessPlacement:
    return dataclasses.replace(placement, reasons=(note, *placement.reasons))
