"""What the user decides about placement (environment variables and ServerArgs), read once into a value."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Optional

from sglang.srt.placement import settings
from sglang.srt.placement.types import AFFINITY_MODES, LAUNCHERS


@dataclass(frozen=True)
class PlacementPolicy:
    """Everything the user decides: env vars and ServerArgs, read once."""

    launcher: str
    device: str
    bind_v2: bool = True
    auto_numa_bind: bool = True
    crash_on_failure: bool = False
    affinity_mode: str = "node"
    numa_nodes: Optional[tuple[int, ...]] = None
    cpu_threads_bind: str = "all"
    """SGLANG_CPU_OMP_THREADS_BIND; read (and checked) only for the CPU device."""
    exec_supported: bool = True
    """False where the launcher cannot start the process under numactl."""

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ValueError(
                f"launcher {self.launcher!r} is not one of {', '.join(LAUNCHERS)}"
            )
        if self.affinity_mode not in AFFINITY_MODES:
            raise ValueError(
                f"SGLANG_NUMA_AFFINITY_MODE / --numa-affinity-mode={self.affinity_mode!r}"
                f" is not valid: choose one of {', '.join(AFFINITY_MODES)}"
            )

    @property
    def in_process_supported(self) -> bool:
        """Whether a rank can bind itself once started: a Ray actor can; a spawned
        child of sglang's multiprocessing path runs sglang's own code, which does not.
        """
        return self.launcher == "ray"

    @classmethod
    def from_env(
        cls,
        server_args: Any,
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
            crash_on_failure=settings.bind_failure_is_fatal(),
            # Checked on every host, one NUMA node or many, so a typo never waits for
            # the host where it matters.
            affinity_mode=affinity_mode or settings.affinity_mode(),
            numa_nodes=tuple(numa_nodes) if numa_nodes is not None else None,
            cpu_threads_bind=settings.cpu_threads_bind() if device == "cpu" else "all",
            exec_supported=exec_supported,
        )


# The ServerArgs fields placement reads, with upstream's defaults: upstream's helpers only
# promise to read ``numa_node``, so a caller may hand in any object that has it.
_PLACEMENT_FIELDS = {
    "tp_size": 1,
    "pp_size": 1,
    "dp_size": 1,
    "nnodes": 1,
    "node_rank": 0,
    "base_gpu_id": 0,
    "gpu_id_step": 1,
    "numa_node": None,
    "device": None,
    "enable_dp_attention": False,
}


def placement_fields(server_args: Any) -> dict[str, Any]:
    """The ServerArgs fields placement reads, taken from any object, with upstream's defaults for those it lacks."""
    fields = {
        name: getattr(server_args, name, default)
        for name, default in _PLACEMENT_FIELDS.items()
    }
    fields["device"] = fields["device"] or "cuda"
    return fields


def placement_view(server_args: Any) -> types.SimpleNamespace:
    """The placement fields of ``server_args``, complete whatever object the caller
    handed in."""
    return types.SimpleNamespace(**placement_fields(server_args))
