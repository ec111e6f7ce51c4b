"""A host given as facts, for ``plan`` (another host's snapshot, a cpuset it stands
for, the GPUs' addresses it is told) and for tests of the decision."""

from __future__ import annotations

import copy
from typing import Mapping, Optional, Sequence

from sglang.srt.placement import settings
from sglang.srt.placement.devices import (
    AcceleratorRuntime,
    gpus_on_node,
    identify_accelerators,
)
from sglang.srt.placement.types import (
    Accelerator,
    DeviceIndex,
    DeviceRef,
    HostTopology,
    NodeChoice,
    ProcessAffinity,
    RankIdentity,
    SettingError,
)


class FactsHost:
    """A host given as facts (``resolve.Host``): its sysfs topology (a ``capture``
    snapshot, or this host's), the CPUs a rank may use, the environment that names its
    GPUs and what gives their PCI addresses. Nothing is probed or bound; a GPU's node is
    its PCI device's; a failed step leaves the placement degraded, with the reason."""

    numactl_path = "numactl"
    libnuma = True

    def __init__(
        self,
        *,
        topology: HostTopology,
        affinity: ProcessAffinity,
        device: str = "cuda",
        numa_nodes: Optional[Sequence[int]] = None,
        env: Optional[Mapping[str, str]] = None,
        runtime: Optional[AcceleratorRuntime] = None,
    ) -> None:
        self._topology, self._affinity, self._env = topology, affinity, env or {}
        self._device = device if device in ("cuda", "xpu") else "cuda"
        self._numa_nodes, self._runtime = numa_nodes, runtime
        self._found: dict[DeviceRef, Accelerator] = {}
        self._node_gpus: dict[int, tuple[str, ...]] = {}

    @property
    def env(self) -> Mapping[str, str]:
        return self._env

    def with_env(self, env: Mapping[str, str]) -> "FactsHost":
        """This host as a rank spawned with ``env`` sees it."""
        found = copy.copy(self)
        found._env, found._found = env, {}
        return found

    def topology(self) -> HostTopology:
        return self._topology

    def affinity(self) -> ProcessAffinity:
        return self._affinity

    def numa_node(self, rank: RankIdentity) -> NodeChoice:
        gpu, listed = rank.device, self._numa_nodes
        if listed is not None:
            node = settings.listed_node(listed, gpu.index)
            return NodeChoice(node, (f"node {node} from --numa-node ({gpu.label})",))
        if self._topology.node(1) is None:  # as upstream's _is_numa_available
            return NodeChoice(
                None, ("this host has one NUMA node: node binding cannot help",)
            )
        try:
            found = self._identify(gpu)
        except SettingError as exc:
            return NodeChoice(None, (f"{gpu.label} cannot be identified: {exc}",), True)
        pci = found.pci
        if pci is None:
            why = f"{gpu.label} ({found.physical_id}): no PCI address ({found.source})"
            return NodeChoice(None, (why,), degraded=True)
        via = f"{gpu.label} is {found.physical_id} at PCI {pci} ({found.source})"
        device = self._topology.pci_device(pci)
        if device is None:
            why = f"PCI {pci} is not in {self._topology.root}"
            return NodeChoice(None, (via, why), degraded=True, pci=pci)
        if device.numa_node is None:
            why = f"PCI {pci} reports numa_node -1 (the kernel does not know its node)"
            return NodeChoice(None, (via, why), pci=pci)
        node = device.numa_node
        return NodeChoice(node, (via, f"node {node} from PCI {pci}"), pci=pci)

    def node_cpus(self, node: int) -> frozenset[int]:
        found = self._topology.node(node)
        return found.cpus if found is not None else frozenset()

    def node_gpus(self, node: int) -> tuple[str, ...]:
        if node not in self._node_gpus:
            found = gpus_on_node(self._topology, device=self._device, node=node)
            self._node_gpus[node] = found
        return self._node_gpus[node]

    def gpu_pci(self, rank: RankIdentity) -> Optional[str]:
        try:
            return self._identify(rank.device).pci
        except SettingError:
            return None

    def can_set_mempolicy(self) -> bool:
        return True

    def probe(self, numactl_args: str) -> tuple[Optional[str], str]:
        return numactl_args, ""

    def fail(self, node: Optional[int], reason: str) -> None:
        return None  # the placement says it: degraded, with the reason

    def cpu_counts(self) -> tuple[int, int]:
        online = self._topology.online_cpus
        return len(self._topology.cores_within(online)), len(online)

    def _identify(self, gpu: DeviceRef) -> Accelerator:
        if gpu not in self._found:
            env = self._env
            if gpu.numbering is DeviceIndex.PHYSICAL_GPU:
                env = {
                    k: v for k, v in env.items() if k not in settings.VISIBILITY_VARS
                }
            self._found[gpu] = identify_accelerators(
                device=self._device,
                topology=self._topology,
                logical_ids=[gpu.index],
                env=env,
                runtime=self._runtime,
            )[0]
        return self._found[gpu]
