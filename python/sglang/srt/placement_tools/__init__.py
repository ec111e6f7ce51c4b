"""Operator tools over placement (plan, verify, capture), which nothing below imports.
``PlanArgs`` stands in for sglang's ``ServerArgs`` (seconds to import): placement reads
the same field names from either."""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Callable, List, Optional

from sglang.srt.placement.cpulist import shown

MAX_RANKS = 65536  # the most ranks one engine may have (tp x pp x dp)
MAX_GPU_ID = 4095
MAX_NUMA_NODE = 1023  # Linux's MAX_NUMNODES at its largest (CONFIG_NODES_SHIFT=10) - 1
DEVICES = ("cuda", "xpu", "cpu")

# Each integer field's sglang flags (messages name the second, if any) and range.
FLAGS = {
    "tp_size": (("--tensor-parallel-size", "--tp-size", "--tp"), 1, MAX_RANKS),
    "pp_size": (("--pipeline-parallel-size", "--pp-size"), 1, MAX_RANKS),
    "dp_size": (("--data-parallel-size", "--dp-size", "--dp"), 1, MAX_RANKS),
    "nnodes": (("--nnodes",), 1, MAX_RANKS),
    "node_rank": (("--node-rank",), 0, MAX_RANKS - 1),
    "base_gpu_id": (("--base-gpu-id",), 0, MAX_GPU_ID),
    "gpu_id_step": (("--gpu-id-step",), 1, MAX_GPU_ID),
    "numa_node": (("--numa-node",), 0, MAX_NUMA_NODE),
}

_INT = re.compile(r"[+-]?[0-9]+")


class UsageError(ValueError):
    """Bad input (flag, setting, file, capture destination): one line, exit status 2."""


def _range_problem(dest: str, value: object, text: str = "") -> Optional[str]:
    names, lowest, highest = FLAGS[dest]
    if type(value) is int and lowest <= value <= highest:
        return None
    flag = names[min(1, len(names) - 1)]
    kind = "a positive" if lowest else "a non-negative"
    return (
        f"{flag}={text or repr(value)} is not valid: it must be {kind} integer up to "
        f"{highest}, e.g. {flag} {lowest}."
    )


def int_arg(dest: str) -> Callable[[str], int]:
    """argparse ``type=``: ASCII digits (no ``٣``, ``1_0`` or ``0x10``), in range."""

    def parse(text: str) -> int:
        word = text.strip()
        if _INT.fullmatch(word) is None:
            raise argparse.ArgumentTypeError(f"invalid int value: {shown(text)}")
        # int() of a 100,000-digit string is slow (and refused past 4300 digits).
        value = int(word) if len(word) <= 12 else None
        problem = _range_problem(dest, value, shown(word, quote=False))
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    return parse


@dataclasses.dataclass
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
        for dest in FLAGS:
            problem = dest != "numa_node" and _range_problem(dest, getattr(self, dest))
            if problem:
                raise UsageError(problem)
        tp, pp, dp, nnodes = self.tp_size, self.pp_size, self.dp_size, self.nnodes
        for problem in (
            tp * pp * dp > MAX_RANKS
            and f"--tp-size={tp} x --pp-size={pp} x --dp-size={dp} = {tp * pp * dp} "
            f"ranks is above the limit of {MAX_RANKS} ranks per engine",
            self.node_rank >= nnodes
            and f"--node-rank={self.node_rank} is not valid with --nnodes={nnodes}: "
            f"node ranks run from 0 to {nnodes - 1}.",
            (tp * pp) % nnodes != 0
            and f"--tp-size={tp} x --pp-size={pp} = {tp * pp} ranks cannot be split "
            f"evenly over --nnodes={nnodes}: make it a multiple of the node count.",
            self.device not in DEVICES
            and f"--device={self.device!r} is not supported here: "
            f"choose one of {', '.join(DEVICES)}.",
        ):
            if problem:
                raise UsageError(problem)
        numa, example = self.numa_node, "e.g. --numa-node 0 0 1 1."
        if numa is None:
            return
        if not isinstance(numa, (list, tuple)) or not numa:
            why = f"is not valid: give one NUMA node id per GPU, {example}"
            raise UsageError(f"--numa-node={numa!r} {why}")
        bad = [node for node in numa if _range_problem("numa_node", node)]
        if bad:
            why = f"NUMA node ids are integers from 0 to {MAX_NUMA_NODE}, {example}"
            raise UsageError(f"--numa-node contains {bad[0]!r}: {why}")
        self.numa_node = list(numa)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """sglang's own flags for the fields; one not given keeps its default."""
        for dest, (names, _, _) in FLAGS.items():
            options = dict(
                type=int_arg(dest), nargs="+" if dest == "numa_node" else None
            )
            parser.add_argument(*names, dest=dest, default=argparse.SUPPRESS, **options)
        parser.add_argument(
            "--device", default=argparse.SUPPRESS, help="cuda, xpu or cpu"
        )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "PlanArgs":
        names = [f.name for f in dataclasses.fields(cls) if hasattr(args, f.name)]
        return cls(**{name: getattr(args, name) for name in names})
