"""The engine settings placement reads: the CLI's flags (``PlanArgs``, upstream's flag names) and the same
fields taken from any ``ServerArgs``.

Placement reads these fields by name from whatever it is given, so sglang's own
``ServerArgs`` works everywhere a ``PlanArgs`` does; the CLI builds this one
because importing ``ServerArgs`` costs seconds and needs a model path.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import List, Optional

from sglang.srt.placement.policy import (  # noqa: F401  (this module's names too)
    placement_fields,
    placement_view,
)

DEVICE_CHOICES = ("cuda", "xpu", "cpu")


class PlanArgsError(ValueError):
    """A PlanArgs value is invalid; the message names the flag and a value that would work."""


@dataclass
class PlanArgs:
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    base_gpu_id: int = 0
    gpu_id_step: int = 1
    numa_node: Optional[List[int]] = None
    device: str = "cuda"

    def __post_init__(self) -> None:
        self.check_server_args()

    def check_server_args(self) -> None:
        for flag, value in (
            ("--tp-size", self.tp_size),
            ("--pp-size", self.pp_size),
            ("--dp-size", self.dp_size),
            ("--nnodes", self.nnodes),
            ("--gpu-id-step", self.gpu_id_step),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanArgsError(
                    f"{flag}={value!r} is not valid: it must be a positive integer, e.g. {flag} 1."
                )
        for flag, value in (
            ("--node-rank", self.node_rank),
            ("--base-gpu-id", self.base_gpu_id),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise PlanArgsError(
                    f"{flag}={value!r} is not valid: it must be a non-negative integer, e.g. {flag} 0."
                )
        if self.node_rank >= self.nnodes:
            raise PlanArgsError(
                f"--node-rank={self.node_rank} is not valid with --nnodes={self.nnodes}: "
                f"node ranks run from 0 to {self.nnodes - 1}."
            )
        if self.nnodes > 1 and (self.tp_size * self.pp_size) % self.nnodes != 0:
            raise PlanArgsError(
                f"--tp-size={self.tp_size} x --pp-size={self.pp_size} = {self.tp_size * self.pp_size} ranks "
                f"cannot be split evenly over --nnodes={self.nnodes}: choose sizes whose product is a multiple of the node count."
            )
        if self.device not in DEVICE_CHOICES:
            raise PlanArgsError(
                f"--device={self.device!r} is not supported here: choose one of {', '.join(DEVICE_CHOICES)}."
            )
        if self.numa_node is not None:
            if not isinstance(self.numa_node, (list, tuple)) or not self.numa_node:
                raise PlanArgsError(
                    f"--numa-node={self.numa_node!r} is not valid: give one NUMA node id per GPU, e.g. --numa-node 0 0 1 1."
                )
            for node in self.numa_node:
                if not isinstance(node, int) or isinstance(node, bool) or node < 0:
                    raise PlanArgsError(
                        f"--numa-node contains {node!r}: NUMA node ids are non-negative integers, e.g. --numa-node 0 0 1 1."
                    )
            self.numa_node = list(self.numa_node)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("parallelism and placement")
        for names, dest, help_text in _CLI_FLAGS:
            group.add_argument(
                *names,
                dest=dest,
                type=str if dest == "device" else int,
                nargs="+" if dest == "numa_node" else None,
                default=_FIELD_DEFAULTS[dest],
                help=help_text,
            )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "PlanArgs":
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(
            **{name: getattr(args, name) for name in names if hasattr(args, name)}
        )


_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(PlanArgs)}
_CLI_FLAGS = (
    (
        ("--tensor-parallel-size", "--tp-size", "--tp"),
        "tp_size",
        "Tensor parallel size.",
    ),
    (("--pipeline-parallel-size", "--pp-size"), "pp_size", "Pipeline parallel size."),
    (("--data-parallel-size", "--dp-size", "--dp"), "dp_size", "Data parallel size."),
    (("--nnodes",), "nnodes", "Number of nodes."),
    (("--node-rank",), "node_rank", "This node's rank."),
    (
        ("--base-gpu-id",),
        "base_gpu_id",
        "The first GPU id to use; ranks count up from it.",
    ),
    (
        ("--gpu-id-step",),
        "gpu_id_step",
        "The distance between the GPU ids of consecutive ranks.",
    ),
    (
        ("--numa-node",),
        "numa_node",
        "The NUMA node of each GPU, indexed by GPU id, e.g. --numa-node 0 0 1 1.",
    ),
    (("--device",), "device", "cuda, xpu or cpu."),
)
"""sglang's own flag names for the PlanArgs fields: (names, dest, help)."""
