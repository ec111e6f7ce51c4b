"""verify: start probe ranks through sglang's own launch path and read each binding back from inside it.

With ``--launcher mp`` every probe rank is started as
``Engine._launch_scheduler_processes`` starts a scheduler: a spawn-context
``Process`` whose ``start()`` runs inside ``numa_utils.configure_subprocess(
server_args, gpu_id)``, for the ids sglang's arithmetic gives
(``placement.ranks``), under ``maybe_reindex_device_id`` when
``SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS=1``, and optionally from one thread per
dp rank as the data-parallel controller does. The probe (the only thing that
differs from a real rank) reports the binding its process has, and each row
compares it with what ``plan`` says for that rank. ``--launcher ray`` is in
``placement.verify_ray``. This is the CLI's layer: it imports the launch path.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import threading
import time
from typing import Any, Callable, Iterator, Optional, Sequence

from sglang.srt.placement.cpulist import format_cpulist
from sglang.srt.placement.types import (
    MemPolicy,
    ProcessPlacement,
    RankIdentity,
    Strategy,
)

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0

# Share of a rank's own (anonymous) resident memory that must sit on its bound node(s).
# exec binds before the first allocation; in-process migrates what was touched before binding,
# and a few pages (e.g. pinned by the kernel or shared) may stay behind.
MIN_LOCAL_PAGE_RATIO = {"exec": 0.99, "in-process": 0.95}


class VerifyError(RuntimeError):
    """A probe rank did not report within the deadline, or failed; the message names it."""


# --------------------------------------------------------------------------- inside a probe rank


def probe_main(label: str, writer: Any) -> None:
    """A probe rank's target (top level, so a spawned child can import it): report its
    binding as the kernel sees it (CPUs, memory nodes, policy, pages), then exit."""
    from sglang.srt.placement_tools.observe import observe_self

    try:
        observed = observe_self().to_dict()
        writer.send(
            {
                "status": "ready",
                "label": label,
                "pid": os.getpid(),
                "observed": observed,
            }
        )
    except (
        BaseException
    ) as exc:  # noqa: BLE001 - the launcher must hear about every failure
        writer.send(
            {"status": "error", "label": label, "error": f"{type(exc).__name__}: {exc}"}
        )
        raise
    finally:
        writer.close()


# --------------------------------------------------------------------------- comparing


def _target_nodes(placement: ProcessPlacement) -> frozenset[int]:
    if placement.strategy == Strategy.NONE:
        return frozenset()
    if placement.mem_nodes:
        return placement.mem_nodes
    return (
        frozenset() if placement.numa_node is None else frozenset([placement.numa_node])
    )


def differences(
    placement: ProcessPlacement, observed: Any, *, unbound_cpus: frozenset[int]
) -> list[str]:
    """Every way a rank's observed binding differs from its placement.

    An unbound rank must have been left alone: the launcher's CPUs and the
    default memory policy. A bound one must hold its CPUs and memory policy,
    and keep most of its own memory on its node(s).
    """
    from sglang.srt.placement_tools.observe import compare_binding

    if placement.strategy == Strategy.NONE:
        found = []
        if observed.cpus != unbound_cpus:
            found.append(
                f"cpus {format_cpulist(observed.cpus)} observed, the launcher's "
                f"{format_cpulist(unbound_cpus)} expected for an unbound rank"
            )
        if observed.policy != "default":
            found.append(
                f"memory policy {observed.policy} observed, default expected for an unbound rank"
            )
        return found
    found = list(compare_binding(placement, observed))
    minimum = MIN_LOCAL_PAGE_RATIO.get(placement.strategy)
    nodes = _target_nodes(placement)
    ratio = observed.local_page_ratio(nodes, anon_only=True) if nodes else None
    if (
        minimum is not None
        and placement.mem_policy == MemPolicy.BIND
        and ratio is not None
        and ratio < minimum
    ):
        found.append(
            f"{ratio:.1%} of the rank's resident anonymous memory is on node(s) {format_cpulist(nodes)}, "
            f"at least {minimum:.0%} expected for strategy {placement.strategy}"
        )
    return found


def verify_row(
    placement: ProcessPlacement,
    report: dict,
    *,
    launcher: str,
    unbound_cpus: frozenset[int],
) -> dict:
    """One output row: the plan's fields, then what the rank observed, and whether they agree."""
    from sglang.srt.placement_tools.observe import ObservedBinding

    observed = ObservedBinding.from_dict(report["observed"])
    nodes = _target_nodes(placement)
    row = placement.to_dict()
    found = differences(placement, observed, unbound_cpus=unbound_cpus)
    policy_nodes = format_cpulist(observed.policy_nodes)
    row.update(
        {
            "launcher": launcher,
            "observed_pid": report.get("pid"),
            "observed_cpus": format_cpulist(observed.cpus),
            "observed_mems": format_cpulist(observed.mems),
            "observed_policy": (
                f"{observed.policy}:{policy_nodes}" if policy_nodes else observed.policy
            ),
            "local_page_ratio": (
                observed.local_page_ratio(nodes, anon_only=True) if nodes else None
            ),
            "local_page_ratio_all": observed.local_page_ratio(nodes) if nodes else None,
            "ok": not found,
            "differences": found,
        }
    )
    for extra in ("node_id", "actor"):
        if extra in report:
            row[extra] = report[extra]
    return row


# --------------------------------------------------------------------------- the multiprocessing path


@contextlib.contextmanager
def _reindexed(gpu_id: int, *, device: str) -> Iterator[int]:
    """sglang's ``maybe_reindex_device_id`` for CUDA ranks (it narrows CUDA_VISIBLE_DEVICES when asked)."""
    from sglang.srt.placement import settings

    if device != "cuda" or not settings.one_visible_device_per_process():
        yield gpu_id
        return
    from sglang.srt.utils.common import maybe_reindex_device_id

    with maybe_reindex_device_id(gpu_id) as reindexed:
        yield reindexed


def run_mp_probes(
    server_args: Any,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    dp_threads: bool = False,
    configure: Optional[Callable[[Any, int], Any]] = None,
) -> list[tuple[RankIdentity, dict]]:
    """Start one probe per local rank as sglang's engine (or, with ``dp_threads``, its data-parallel
    controller) spawns schedulers, each ``start()`` inside ``configure_subprocess(server_args, gpu_id)``;
    return (rank, report) pairs in launch order. Every probe ends, or is killed, within ``timeout_s``.

    ``configure`` replaces ``numa_utils.configure_subprocess`` (tests that show verify notices a bypass).
    """
    from sglang.srt.placement.ranks import local_ranks

    if configure is None:
        from sglang.srt.utils import numa_utils

        configure = numa_utils.configure_subprocess
    ctx = multiprocessing.get_context("spawn")
    ranks = list(local_ranks(server_args))
    device = getattr(server_args, "device", "cuda")
    started: list[tuple[RankIdentity, Any, Any]] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def spawn(rank: RankIdentity) -> None:
        reader, writer = ctx.Pipe(duplex=False)
        with _reindexed(rank.gpu_id, device=device) as gpu_id:
            proc = ctx.Process(
                target=probe_main,
                args=(rank.label, writer),
                name=f"verify-{rank.label}",
            )
            with configure(server_args, gpu_id):
                proc.start()
        writer.close()
        started.append((rank, proc, reader))

    def spawn_group(group: list[RankIdentity]) -> None:
        try:
            for rank in group:
                with lock:  # the data-parallel controller's env_lock
                    spawn(rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the launching thread
            errors.append(exc)

    try:
        if dp_threads:
            groups: dict[int, list[RankIdentity]] = {}
            for rank in ranks:
                groups.setdefault(rank.dp_rank, []).append(rank)
            threads = [
                threading.Thread(target=spawn_group, args=(g,), name=f"verify-dp{d}")
                for d, g in groups.items()
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            if errors:
                raise errors[0]
        else:
            for rank in ranks:
                spawn(rank)
        return _collect(started, timeout_s=timeout_s)
    finally:
        for _, proc, reader in started:
            reader.close()
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()


def _collect(
    started: Sequence[tuple[RankIdentity, Any, Any]], *, timeout_s: float
) -> list[tuple[RankIdentity, dict]]:
    from multiprocessing.connection import wait

    deadline = time.monotonic() + timeout_s
    reports: dict[int, dict] = {}
    while len(reports) < len(started):
        pending = {
            id(reader): (i, rank, proc, reader)
            for i, (rank, proc, reader) in enumerate(started)
            if i not in reports
        }
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            who = ", ".join(rank.label for _, rank, _, _ in pending.values())
            raise VerifyError(
                f"{who}: no report within {timeout_s:g} s (see the rank's output above)"
            )
        ready = wait(
            [entry[3] for entry in pending.values()]
            + [entry[2].sentinel for entry in pending.values()],
            timeout=remaining,
        )
        for i, rank, proc, reader in pending.values():
            if reader in ready or reader.poll():
                try:
                    report = reader.recv()
                except EOFError:
                    report = None
                if report is None or report.get("status") != "ready":
                    why = (report or {}).get(
                        "error"
                    ) or f"it exited with status {proc.exitcode}"
                    raise VerifyError(f"{rank.label}: the probe rank failed: {why}")
                reports[i] = report
            elif proc.sentinel in ready and not reader.poll():
                proc.join(timeout=1)
                raise VerifyError(
                    f"{rank.label}: the probe rank exited with status {proc.exitcode} before reporting "
                    "(see its output above)"
                )
    return [(rank, reports[i]) for i, (rank, _, _) in enumerate(started)]


def verify_mp(
    server_args: Any,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    dp_threads: bool = False,
    configure: Optional[Callable[[Any, int], Any]] = None,
) -> list[dict]:
    """One row per local rank: what ``plan`` says sglang's spawn does, against what the spawned rank observed."""
    from sglang.srt.placement.plan import plan_engine
    from sglang.srt.placement.topology import read_process_affinity

    placements = plan_engine(server_args, launcher="mp")
    reports = run_mp_probes(
        server_args, timeout_s=timeout_s, dp_threads=dp_threads, configure=configure
    )
    unbound_cpus = read_process_affinity().cpus
    by_label = {p.label: p for p in placements}
    return [
        verify_row(
            by_label[rank.label], report, launcher="mp", unbound_cpus=unbound_cpus
        )
        for rank, report in reports
    ]


# --------------------------------------------------------------------------- output


def _percent(ratio: Optional[float]) -> str:
    return "n/a" if ratio is None else f"{ratio:.1%}"


def format_verify_rows(rows: Sequence[dict]) -> str:
    """One line per rank, in the spirit of Slurm's --cpu-bind=verbose: planned vs observed, then OK or why not."""
    lines = []
    for row in rows:
        label = f"DP{row['dp_rank']} PP{row['pp_rank']} TP{row['tp_rank']}"
        gpu = f" gpu_id {row['gpu_id']}" if row.get("gpu_id") is not None else ""
        pci = f" ({row['pci']})" if row.get("pci") else ""
        node = row.get("numa_node")
        planned_mem = f"{row.get('mem_policy')}:{row.get('mem_nodes') or '-'}"
        head = (
            f"[{label}] {row.get('launcher')}{gpu}{pci} node {'-' if node is None else node} via "
            f"{row.get('strategy')}: cpus {row.get('observed_cpus')} (plan {row.get('cpus') or 'unbound'}), "
            f"mems {row.get('observed_mems')}, policy {row.get('observed_policy')} (plan {planned_mem}), "
            f"local pages {_percent(row.get('local_page_ratio'))}"
        )
        if row.get("ok"):
            lines.append(f"{head}: OK")
        else:
            lines.append(
                f"{head}: MISMATCH: "
                + "; ".join(row.get("differences") or ["unknown difference"])
            )
    return "\n".join(lines)
