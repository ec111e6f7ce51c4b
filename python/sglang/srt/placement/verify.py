"""verify: start the ranks through a real launcher and read each rank's binding back from inside it.

The probe runs as the scheduler ``target`` of the launcher protocol, after the
launcher applied the placement (numactl before the interpreter, or in-process
in ``configure_scheduler_process``), so what it sees is what a scheduler would
get. Rows carry the plan's fields and what was observed, one per rank.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Optional, Sequence

from sglang.srt.placement.cpulist import format_cpulist
from sglang.srt.placement.types import MemPolicy, ProcessPlacement, RankIdentity, Strategy

logger = logging.getLogger(__name__)

LAUNCHER_CHOICES = ("mp", "ray", "both")
DEFAULT_TIMEOUT_S = 300.0

# Share of a rank's own (anonymous) resident memory that must sit on its bound node(s).
# exec binds before the first allocation; in-process migrates what was touched before binding,
# and a few pages (e.g. pinned by the kernel or shared) may stay behind.
MIN_LOCAL_PAGE_RATIO = {"exec": 0.99, "in-process": 0.95}


class VerifyProbe:
    """The scheduler stand-in verify starts in each rank: it only reports the rank's binding."""

    def __init__(self, *, placement: Optional[ProcessPlacement]) -> None:
        self.placement = placement

    def ready_info(self) -> dict:
        from sglang.srt.placement import observe

        observed = observe.observe_self()
        differences = observe.compare_binding(self.placement, observed) if self.placement is not None else []
        nodes = _target_nodes(self.placement)
        return {
            "observed": observed.to_dict(),
            "differences": list(differences),
            "local_page_ratio": observed.local_page_ratio(nodes, anon_only=True) if nodes else None,
            "local_page_ratio_all": observed.local_page_ratio(nodes) if nodes else None,
        }


def probe_target(*, server_args: Any, placement: Optional[ProcessPlacement], rank: RankIdentity) -> VerifyProbe:
    """Launcher-protocol target (importable, top level) that makes each rank report its binding."""
    return VerifyProbe(placement=placement)


def _target_nodes(placement: Optional[ProcessPlacement]) -> frozenset[int]:
    if placement is None or placement.strategy == Strategy.NONE:
        return frozenset()
    if placement.mem_nodes:
        return placement.mem_nodes
    return frozenset() if placement.numa_node is None else frozenset([placement.numa_node])


def page_ratio_difference(placement: ProcessPlacement, ratio: Optional[float]) -> Optional[str]:
    """A difference line when a bound rank keeps too little of its memory on its node; None when fine."""
    minimum = MIN_LOCAL_PAGE_RATIO.get(placement.strategy)
    if minimum is None or placement.mem_policy != MemPolicy.BIND or ratio is None:
        return None
    if ratio >= minimum:
        return None
    return (
        f"{ratio:.1%} of the rank's resident anonymous memory is on node(s) "
        f"{format_cpulist(_target_nodes(placement))}, at least {minimum:.0%} expected for strategy {placement.strategy}"
    )


def verify_row(result: Any, *, launcher: str) -> dict:
    """One output row from a launcher's RankResult: the plan's fields, then what the rank observed."""
    placement: ProcessPlacement = result.placement
    info = dict(result.info or {})
    observed = info.get("observed") or {}
    differences = list(info.get("differences") or [])
    ratio = info.get("local_page_ratio")
    extra = page_ratio_difference(placement, ratio)
    if extra is not None:
        differences.append(extra)
    policy = observed.get("policy")
    policy_nodes = observed.get("policy_nodes") or ""
    row = placement.to_dict()
    row.update(
        {
            "launcher": launcher,
            "observed_cpus": observed.get("cpus"),
            "observed_mems": observed.get("mems"),
            "observed_policy": f"{policy}:{policy_nodes}" if policy and policy_nodes else policy,
            "local_page_ratio": ratio,
            "local_page_ratio_all": info.get("local_page_ratio_all"),
            "ok": not differences,
            "differences": differences,
        }
    )
    return row


def verify_ranks(
    server_args: Any,
    *,
    launcher: str,
    placements: Optional[Sequence[ProcessPlacement]] = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    plan_kwargs: Optional[Mapping[str, Any]] = None,
    runners: Mapping[str, Callable[..., list]],
) -> list[dict]:
    """Start every local rank through ``launcher`` ("mp", "ray" or "both") with the probe; one row per rank.

    ``plan_kwargs`` go to ``plan_engine`` for the mp launcher (``placements``
    replaces that plan); Ray ranks resolve on their own node, with ``gpus`` and
    ``affinity_mode`` from ``plan_kwargs`` passed along.
    """
    if launcher not in LAUNCHER_CHOICES:
        raise ValueError(f"--launcher={launcher!r} is not valid: choose one of {', '.join(LAUNCHER_CHOICES)}")
    missing = [name for name in (("mp", "ray") if launcher == "both" else (launcher,)) if name not in runners]
    if missing:
        raise ValueError(f"no runner for launcher(s) {', '.join(missing)}: pass runners={{name: run}}")
    run = runners
    names = ("mp", "ray") if launcher == "both" else (launcher,)
    rows: list[dict] = []
    for name in names:
        results = run[name](
            server_args,
            placements=placements if name == "mp" else None,
            timeout_s=timeout_s,
            plan_kwargs=dict(plan_kwargs or {}),
        )
        rows.extend(verify_row(result, launcher=name) for result in results)
    return rows


def _percent(ratio: Optional[float]) -> str:
    return "n/a" if ratio is None else f"{ratio:.1%}"


def format_verify_rows(rows: Sequence[dict]) -> str:
    """One line per rank, in the spirit of Slurm's --cpu-bind=verbose: planned vs observed, then OK or why not."""
    lines = []
    for row in rows:
        label = f"DP{row['dp_rank']} PP{row['pp_rank']} TP{row['tp_rank']}"
        gpu = f" GPU {row['gpu_id']}" if row.get("gpu_id") is not None else ""
        pci = f" ({row['pci']})" if row.get("pci") else ""
        node = row.get("numa_node")
        planned_mem = f"{row.get('mem_policy')}:{row.get('mem_nodes') or '-'}"
        head = (
            f"[{label}] {row.get('launcher')}{gpu}{pci} node {'-' if node is None else node} via {row.get('strategy')}: "
            f"cpus {row.get('observed_cpus')} (plan {row.get('cpus') or 'any'}), "
            f"mems {row.get('observed_mems')}, policy {row.get('observed_policy')} (plan {planned_mem}), "
            f"local pages {_percent(row.get('local_page_ratio'))}"
        )
        if row.get("ok"):
            lines.append(f"{head}: OK")
        else:
            lines.append(f"{head}: MISMATCH: " + "; ".join(row.get("differences") or ["unknown difference"]))
    return "\n".join(lines)
