"""numactl: the options that apply a binding, and a probe, cached per option set, of
which memory policy the kernel accepts."""

from __future__ import annotations

import itertools
import shutil
import subprocess
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Optional, Sequence

from sglang.srt.placement.cpulist import format_cpulist
from sglang.srt.placement.types import MemPolicy

PROBE_TIMEOUT_S = 10.0
_LADDER = ("bind", "preferred", "none")
# Upstream's words for a weaker step, which operators search logs for.
_FALLBACK = {
    "preferred": ("hard memory binding", "soft preferred policy"),
    "none": ("memory binding", "CPU-only binding"),
}


def find_numactl() -> Optional[str]:
    return shutil.which("numactl")


def true_program() -> str:
    return shutil.which("true") or "/bin/true"


def cpu_option(*, cpus: Iterable[int], whole_nodes: Optional[Sequence[int]]) -> str:
    if whole_nodes:
        return f"--cpunodebind={format_cpulist(whole_nodes)}"
    return f"--physcpubind={format_cpulist(cpus)}"


def memory_options(
    *, mem_policy: str, mem_nodes: Iterable[int], preferred_node: Optional[int]
) -> tuple[str, ...]:
    if mem_policy == MemPolicy.BIND:
        return (f"--membind={format_cpulist(mem_nodes)}",)
    if mem_policy == MemPolicy.PREFERRED and preferred_node is not None:
        return (f"--preferred={preferred_node}",)
    return ()


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    message: str  # numactl's reason when it refused


@dataclass(frozen=True)
class LadderOutcome:
    mem_policy: str  # the strongest numactl accepted with the CPU option
    args: tuple[str, ...]
    reasons: tuple[str, ...]
    ok: bool  # False when even the CPU option alone was refused


def run_numactl(argv: Sequence[str]) -> ProbeResult:
    try:
        done = subprocess.run(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=PROBE_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return ProbeResult(ok=False, message=f"{argv[0]} could not be run: {exc}")
    if done.returncode == 0:
        return ProbeResult(True, "")
    # numactl follows a refusal with its usage text; the lines before it say why.
    lines = done.stderr.decode(errors="replace").splitlines()
    reason = itertools.takewhile(lambda line: not line.startswith("usage:"), lines)
    why = "; ".join(line.strip() for line in reason if line.strip())
    return ProbeResult(False, why or f"{argv[0]} exited with status {done.returncode}")


class NumactlProber:
    """Runs ``numactl <options> true`` at most once per option set."""

    def __init__(
        self,
        *,
        numactl_path: str,
        true_path: Optional[str] = None,
        run: Callable[[Sequence[str]], ProbeResult] = run_numactl,
    ) -> None:
        self.numactl_path = numactl_path
        self.true_path = true_path or true_program()
        self._run = run
        self._results: dict[tuple[str, ...], ProbeResult] = {}
        self._lock = threading.Lock()
        self.probe_count = 0

    def probe(self, args: Sequence[str]) -> ProbeResult:
        key = tuple(args)
        with self._lock:
            if key not in self._results:
                self.probe_count += 1
                argv = [self.numactl_path, *key, self.true_path]
                self._results[key] = self._run(argv)
            return self._results[key]

    def ladder(
        self,
        *,
        cpu_args: Sequence[str],
        mem_policy: str,
        mem_nodes: Iterable[int],
        preferred_node: Optional[int],
    ) -> LadderOutcome:
        """Bind, preferred, CPUs only, from ``mem_policy`` down: the first accepted."""
        nodes = sorted(mem_nodes)
        start = _LADDER.index(mem_policy) if mem_policy in _LADDER else 2
        refused: list[tuple[str, str]] = []  # (options, numactl's reason)
        for step in _LADDER[start:]:
            if step == "preferred" and preferred_node is None:
                continue
            memory = memory_options(
                mem_policy=step, mem_nodes=nodes, preferred_node=preferred_node
            )
            args = (*cpu_args, *memory)
            result = self.probe(args)
            if not result.ok:
                refused.append((" ".join(args), result.message))
                continue
            if not refused:
                return LadderOutcome(step, args, (), ok=True)
            first, why = refused[0]
            lost, kept = _FALLBACK[step]
            reason = (
                f"numactl rejected {lost} ({first!r}){why and ': ' + why}; "
                f"falling back to {kept} ({' '.join(args)!r})"
            )
            return LadderOutcome(step, args, (reason,), ok=True)
        return LadderOutcome("none", (), (refused[-1][1],), ok=False)


class AssumedNumactl(NumactlProber):
    """Stands in for the prober when planning from a sysfs snapshot: nothing runs."""

    def __init__(self, *, root: str) -> None:
        super().__init__(numactl_path="numactl", run=lambda _: ProbeResult(True, ""))
        self.root = root

    def ladder(self, **step: Any) -> LadderOutcome:
        outcome = super().ladder(**step)
        reason = (
            f"planned from the snapshot {self.root}: assumes numactl there accepts "
            f"{' '.join(outcome.args)} (not probed)"
        )
        return replace(outcome, reasons=(reason,))


_probers: dict[str, NumactlProber] = {}


def default_prober() -> Optional[NumactlProber]:
    path = find_numactl()
    if path is None:
        return None
    # setdefault is atomic: threads asking at once share one prober and its cache.
    return _probers.get(path) or _probers.setdefault(
        path, NumactlProber(numactl_path=path)
    )
