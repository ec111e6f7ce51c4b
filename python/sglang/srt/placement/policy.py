"""What the user decides about placement (env vars, ServerArgs), read once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from sglang.srt.placement import settings
from sglang.srt.placement.modes import AffinityMode
from sglang.srt.placement.types import Launcher

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

_MODE_SETTING = "SGLANG_NUMA_AFFINITY_MODE / --numa-affinity-mode"


@dataclass(frozen=True)
class PlacementPolicy:
    launcher: Launcher
    device: str
    bind_v2: bool = True
    auto_numa_bind: bool = True
    affinity_mode: AffinityMode = AffinityMode.NODE
    numa_nodes: Optional[tuple[int, ...]] = None
    cpu_threads_bind: str = "all"  # read (and checked) only for the CPU device

    def __post_init__(self) -> None:
        # Callers may name the enums by their values.
        if self.launcher not in tuple(Launcher):
            choices = ", ".join(Launcher)
            raise ValueError(f"launcher {self.launcher!r} is not one of {choices}")
        object.__setattr__(self, "launcher", Launcher(self.launcher))
        mode = AffinityMode.parse(self.affinity_mode, setting=_MODE_SETTING)
        object.__setattr__(self, "affinity_mode", mode)

    @property
    def exec_supported(self) -> bool:  # Ray starts its actors: they bind themselves
        return self.launcher is Launcher.MP

    @classmethod
    def from_env(
        cls, server_args: "ServerArgs", *, launcher: Launcher
    ) -> "PlacementPolicy":
        # Upstream's helpers promise to read only these fields: any object will do.
        device = getattr(server_args, "device", None) or "cuda"
        numa_nodes = getattr(server_args, "numa_node", None)
        return cls(
            launcher=launcher,
            device=device,
            bind_v2=settings.bind_v2(),
            auto_numa_bind=settings.auto_numa_bind(),
            # Checked on every host: a typo never waits for the host where it matters.
            affinity_mode=settings.affinity_mode(),
            numa_nodes=tuple(numa_nodes) if numa_nodes is not None else None,
            cpu_threads_bind=settings.cpu_threads_bind() if device == "cpu" else "all",
        )
