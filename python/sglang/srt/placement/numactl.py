"""numactl: the one lookup of the program, the options that apply a binding, and a
probe, once per option set, of the strongest memory policy the kernel accepts."""

from __future__ import annotations

import itertools
import shutil
import subprocess
import threading
from dataclasses import dataclass
from subprocess import DEVNULL, PIPE, TimeoutExpired
from typing import Collection, Iterable, Optional, Sequence

from sglang.srt.placement.cpulist import format_cpulist
from sglang.srt.placement.types import MemPolicy, descend

TIMEOUT_S = 10.0
_FALLBACK = {
    MemPolicy.PREFERRED: ("hard memory binding", "soft preferred policy"),
    MemPolicy.NONE: ("memory binding", "CPU-only binding"),
}


def find_numactl() -> Optional[str]:
    return shutil.which("numactl")


def cpu_option(*, cpus: Iterable[int], whole_nodes: Optional[Sequence[int]]) -> str:
    if whole_nodes:
        return f"--cpunodebind={format_cpulist(whole_nodes)}"
    return f"--physcpubind={format_cpulist(cpus)}"


def memory_options(
    *, mem_policy: MemPolicy, mem_nodes: Iterable[int], preferred_node: Optional[int]
) -> tuple[str, ...]:
    if mem_policy == MemPolicy.BIND:
        return (f"--membind={format_cpulist(mem_nodes)}",)
    if mem_policy == MemPolicy.PREFERRED and preferred_node is not None:
        return (f"--preferred={preferred_node}",)
    return ()


def run_numactl(argv: Sequence[str]) -> Optional[str]:
    """None when ``argv`` ran and exited 0; else why not, in numactl's words."""
    try:
        done = subprocess.run(
            list(argv), stdin=DEVNULL, stdout=DEVNULL, stderr=PIPE, timeout=TIMEOUT_S
        )
    except (OSError, TimeoutExpired) as exc:
        return f"{argv[0]} could not be run: {exc}"
    if done.returncode == 0:
        return None
    # numactl follows a refusal with its usage text; the lines before it say why.
    lines = done.stderr.decode(errors="replace").splitlines()
    reason = itertools.takewhile(lambda line: not line.startswith("usage:"), lines)
    why = "; ".join(line.strip() for line in reason if line.strip())
    return why or f"{argv[0]} exited with status {done.returncode}"


@dataclass(frozen=True)
class LadderOutcome:
    mem_policy: MemPolicy  # the strongest numactl accepted with the CPU option
    args: tuple[str, ...]  # empty when even the CPU option alone was refused
    reasons: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return bool(self.args)


class NumactlProber:
    """Runs ``numactl <options> true`` at most once per option set."""

    def __init__(self, *, numactl_path: str) -> None:
        self.numactl_path = numactl_path
        self._true = shutil.which("true") or "/bin/true"
        self._results: dict[tuple[str, ...], Optional[str]] = {}
        self._lock = threading.Lock()

    def probe(self, args: Sequence[str]) -> Optional[str]:
        key = tuple(args)
        with self._lock:
            if key not in self._results:
                self._results[key] = run_numactl([self.numactl_path, *key, self._true])
            return self._results[key]

    def ladder(
        self,
        *,
        cpu_args: Sequence[str],
        mem_policy: MemPolicy,
        mem_nodes: Collection[int],
        preferred_node: Optional[int],
    ) -> LadderOutcome:
        """Bind, preferred, CPUs only, from ``mem_policy`` down: the first accepted."""

        def argv(step: MemPolicy) -> tuple[str, ...]:
            memory = memory_options(
                mem_policy=step, mem_nodes=mem_nodes, preferred_node=preferred_node
            )
            return (*cpu_args, *memory)

        got, refused = descend(mem_policy, lambda step: self.probe(argv(step)))
        if refused and refused[-1].policy is MemPolicy.NONE:
            return LadderOutcome(MemPolicy.NONE, (), (refused[-1].why,))
        reasons: tuple[str, ...] = ()
        if refused:  # upstream's words for the step down, which operators search for
            first, (lost, kept) = refused[0], _FALLBACK[got]
            why = first.why and f": {first.why}"
            reasons = (
                f"numactl rejected {lost} ({' '.join(argv(first.policy))!r}){why}; "
                f"falling back to {kept} ({' '.join(argv(got))!r})",
            )
        return LadderOutcome(got, argv(got), reasons)


_probers: dict[str, NumactlProber] = {}


def default_prober() -> Optional[NumactlProber]:
    path = find_numactl()
    if path is None:
        return None
    prober = _probers.get(path) or NumactlProber(numactl_path=path)
    # setdefault is atomic: threads asking at once share one prober and its cache.
    return _probers.setdefault(path, prober)
