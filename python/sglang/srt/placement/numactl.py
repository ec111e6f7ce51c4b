"""numactl: the options that apply a binding, and a cached probe of which memory policy the kernel accepts."""

from __future__ import annotations

import logging
import shutil
import subprocess
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

from sglang.srt.placement.cpulist import format_cpulist
from sglang.srt.placement.types import MemPolicy, ProcessPlacement, Strategy

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 10.0


def find_numactl() -> Optional[str]:
    return shutil.which("numactl")


def cpu_option(*, cpus: Iterable[int], whole_nodes: Optional[Sequence[int]]) -> str:
    """``--cpunodebind`` when the CPU set is exactly some nodes' CPUs, else ``--physcpubind``."""
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
    message: str
    """numactl's stderr (first line) when it refused, else empty."""


@dataclass(frozen=True)
class LadderOutcome:
    """The strongest memory policy numactl could apply with a CPU option, and why."""

    mem_policy: str
    args: tuple[str, ...]
    reasons: tuple[str, ...]
    ok: bool
    """False when even the CPU-only form was refused (the placement then cannot use exec)."""


def run_numactl(argv: Sequence[str]) -> ProbeResult:
    """Run ``argv`` (numactl, options, a program) once; numactl's reason when it refuses."""
    try:
        done = subprocess.run(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return ProbeResult(ok=False, message=f"{argv[0]} could not be run: {exc}")
    if done.returncode == 0:
        return ProbeResult(ok=True, message="")
    return ProbeResult(
        ok=False,
        message=_reason(done.stderr.decode(errors="replace"))
        or f"{argv[0]} exited with status {done.returncode}",
    )


def _reason(stderr: str) -> str:
    # numactl follows a refusal with its whole usage text; the lines before it are the reason.
    lines = []
    for line in stderr.splitlines():
        if line.startswith("usage:"):
            break
        if line.strip():
            lines.append(line.strip())
    return "; ".join(lines)


class NumactlProber:
    """Runs ``numactl <options> true`` at most once per distinct option set and remembers the answer."""

    def __init__(
        self,
        *,
        numactl_path: str,
        true_path: Optional[str] = None,
        run: Callable[[Sequence[str]], ProbeResult] = run_numactl,
    ) -> None:
        self.numactl_path = numactl_path
        self.true_path = true_path or shutil.which("true") or "/bin/true"
        self._run = run
        self._results: dict[tuple[str, ...], ProbeResult] = {}
        self._lock = threading.Lock()
        self.probe_count = 0

    def probe(self, args: Sequence[str]) -> ProbeResult:
        key = tuple(args)
        with self._lock:
            cached = self._results.get(key)
            if cached is not None:
                return cached
            self.probe_count += 1
            result = self._run([self.numactl_path, *key, self.true_path])
            self._results[key] = result
        if not result.ok:
            logger.debug(f"numactl {' '.join(key)} refused: {result.message}")
        return result

    def ladder(
        self,
        *,
        cpu_args: Sequence[str],
        mem_policy: str,
        mem_nodes: Iterable[int],
        preferred_node: Optional[int],
    ) -> LadderOutcome:
        """Try bind, then preferred, then CPU only; stop at the first the kernel accepts."""
        mem_nodes = tuple(sorted(mem_nodes))
        ladder = ("bind", "preferred", "none")
        steps = (
            ladder[ladder.index(mem_policy) :] if mem_policy in ladder else ("none",)
        )
        # (options, numactl's refusal), strongest first
        tried: list[tuple[tuple[str, ...], str]] = []
        for step in steps:
            if step == "preferred" and preferred_node is None:
                continue
            args = tuple(cpu_args) + memory_options(
                mem_policy=step, mem_nodes=mem_nodes, preferred_node=preferred_node
            )
            result = self.probe(args)
            if result.ok:
                return LadderOutcome(
                    mem_policy=step,
                    args=args,
                    reasons=_fallback_reasons(tried, step, args),
                    ok=True,
                )
            tried.append((args, result.message))
        return LadderOutcome(
            mem_policy=MemPolicy.NONE,
            args=(),
            reasons=(tried[-1][1],) if tried else (),
            ok=False,
        )


def _fallback_reasons(
    tried: Sequence[tuple[tuple[str, ...], str]], step: str, args: tuple[str, ...]
) -> tuple[str, ...]:
    """Upstream's wording for a weaker binding that numactl accepted, which operators search logs for."""
    if not tried:
        return ()
    first_args, first_refusal = tried[0]
    suffix = f": {first_refusal}" if first_refusal else ""
    if step == "preferred":
        return (
            f"numactl rejected hard memory binding ({' '.join(first_args)!r}){suffix}; falling back to soft "
            f"preferred policy ({' '.join(args)!r})",
        )
    return (
        f"numactl rejected memory binding ({' '.join(first_args)!r}){suffix}; falling back to CPU-only "
        f"binding ({' '.join(args)!r})",
    )


class AssumedNumactl:
    """Stands in for the prober when planning from a sysfs snapshot: nothing runs on this host."""

    def __init__(self, *, root: str, numactl_path: str = "numactl") -> None:
        self.root = root
        self.numactl_path = numactl_path
        self.probe_count = 0

    def ladder(
        self,
        *,
        cpu_args: Sequence[str],
        mem_policy: str,
        mem_nodes: Iterable[int],
        preferred_node: Optional[int],
    ) -> LadderOutcome:
        args = tuple(cpu_args) + memory_options(
            mem_policy=mem_policy,
            mem_nodes=tuple(sorted(mem_nodes)),
            preferred_node=preferred_node,
        )
        reason = f"planned from the snapshot {self.root}: assumes numactl there accepts {' '.join(args)} (not probed)"
        return LadderOutcome(
            mem_policy=mem_policy, args=args, reasons=(reason,), ok=True
        )


_default_prober: Optional[NumactlProber] = None
_default_lock = threading.Lock()


def default_prober() -> Optional[NumactlProber]:
    """The process's prober for the numactl on PATH, or None when numactl is not installed."""
    global _default_prober
    with _default_lock:
        path = find_numactl()
        if path is None:
            return None
        if _default_prober is None or _default_prober.numactl_path != path:
            _default_prober = NumactlProber(numactl_path=path)
        return _default_prober


def exec_refusal(placement: ProcessPlacement) -> Optional[str]:
    """numactl's reason for refusing an exec placement's options on this host, from the cached probe; None if fine.

    Planning on this host already probed these options, so this costs nothing there.
    """
    prober = default_prober()
    if prober is None or not placement.numactl_args:
        return None
    result = prober.probe(placement.numactl_args)
    return None if result.ok else result.message


def numactl_prefix(
    placement: ProcessPlacement, *, numactl_path: Optional[str] = None
) -> list[str]:
    """argv that starts a program under ``placement``: [numactl, *options]; the program follows."""
    if placement.strategy != Strategy.EXEC or not placement.numactl_args:
        raise ValueError(
            f"{placement.label}: strategy {placement.strategy!r} has no numactl command; only exec placements do"
        )
    path = numactl_path or find_numactl()
    if path is None:
        raise FileNotFoundError(
            f"{placement.label}: numactl is not on PATH; install the numactl package or set SGLANG_NUMA_BIND_V2=0"
        )
    return [path, *placement.numactl_args]
