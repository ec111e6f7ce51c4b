"""What the user decides about placement (env vars, ServerArgs), read once."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from sglang.srt.placement import settings
from sglang.srt.placement.types import AFFINITY_MODES, LAUNCHERS

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs


@dataclass(frozen=True)
class PlacementPolicy:
    launcher: str
    device: str
    bind_v2: bool = True
    auto_numa_bind: bool = True
    affinity_mode: str = "node"
    numa_nodes: Optional[tuple[int, ...]] = None
    cpu_threads_bind: str = "all"  # read (and checked) only for the CPU device
    exec_supported: bool = True  # False where the launcher cannot exec numactl

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ValueError(
                f"launcher {self.launcher!r} is not one of {', '.join(LAUNCHERS)}"
            )
        if self.affinity_mode not in AFFINITY_MODES:
            raise settings.SettingError(
                "SGLANG_NUMA_AFFINITY_MODE / --numa-affinity-mode="
                f"{self.affinity_mode!r} is not valid: choose one of "
                f"{', '.join(AFFINITY_MODES)}"
            )

    @classmethod
    def from_env(
        cls,
        server_args: "ServerArgs",
        *,
        launcher: str,
        affinity_mode: Optional[str] = None,
        exec_supported: bool = True,
    ) -> "PlacementPolicy":
        device = getattr(server_args, "device", None) or "cuda"
        numa_nodes = getattr(server_args, "numa_node", None)
        return cls(
            launcher=launcher,
            device=device,
            bind_v2=settings.bind_v2(),
            auto_numa_bind=settings.auto_numa_bind(),
            # Checked on every host: a typo never waits for the host where it matters.
            affinity_mode=affinity_mode or settings.affinity_mode(),
            numa_nodes=tuple(numa_nodes) if numa_nodes is not None else None,
            cpu_threads_bind=settings.cpu_threads_bind() if device == "cpu" else "all",
            exec_supported=exec_supported,
        )


# Upstream's helpers promise to read only ``numa_node``, so a caller may hand in any
# object: these are the fields placement reads, with upstream's defaults.
_PLACEMENT_FIELDS = dict(tp_size=1, pp_size=1, dp_size=1, nnodes=1, gpu_id_step=1)
_PLACEMENT_FIELDS.update(node_rank=0, base_gpu_id=0, numa_node=None, device=None)


def placement_view(server_args: Any) -> types.SimpleNamespace:
    fields = {k: getattr(server_args, k, v) for k, v in _PLACEMENT_FIELDS.items()}
    fields["device"] = fields["device"] or "cuda"
    return types.SimpleNamespace(**fields)
