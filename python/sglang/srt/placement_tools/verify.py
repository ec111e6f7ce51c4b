"""verify: start probe ranks through sglang's own launch path and read each binding back from inside.

With ``--launcher mp`` every probe rank is started as ``Engine._launch_scheduler_processes``
starts a scheduler: a spawn-context ``Process`` whose ``start()`` runs inside
``numa_utils.configure_subprocess(server_args, gpu_id)``, for the ids sglang's arithmetic
gives, under ``maybe_reindex_device_id`` when ``SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS=1``,
and optionally from one thread per dp rank as the data-parallel controller does. Only
the probe differs from a real rank: it reports the binding its process has, and each row
compares that with what ``plan`` says. ``--launcher ray`` is in ``verify_ray``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
from typing import Any, Iterator, Optional, Sequence

from sglang.srt.placement.cpulist import format_cpulist
from sglang.srt.placement.types import (
    MemPolicy,
    PlacementError,
    ProcessPlacement,
    RankIdentity,
    Strategy,
)

# Share of a rank's own (anonymous) resident memory that must sit on its bound node(s).
# exec binds before the first allocation; in-process migrates what was touched before binding,
# and a few pages (e.g. pinned by the kernel or shared) may stay behind.
MIN_LOCAL_PAGE_RATIO = {"exec": 0.99, "in-process": 0.95}


def probe_main(writer: Any) -> None:
    """A probe rank's target (top level, so a spawned child can import it)."""
    from sglang.srt.placement_tools.observe import observe_self

    try:
        writer.send({"pid": os.getpid(), "observed": observe_self().to_dict()})
    except BaseException as exc:  # noqa: BLE001 - the launcher hears of every failure
        writer.send({"error": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        writer.close()


def _target_nodes(placement: ProcessPlacement) -> frozenset[int]:
    if placement.strategy == Strategy.NONE:
        return frozenset()
    if placement.mem_nodes or placement.numa_node is None:
        return placement.mem_nodes
    return frozenset([placement.numa_node])


def differences(
    placement: ProcessPlacement, observed: Any, *, unbound_cpus: frozenset[int]
) -> list[str]:
    """Every way a rank's observed binding differs from its placement.

    An unbound rank must have been left alone: the launcher's CPUs and the default memory
    policy. A bound one must hold its CPUs and memory policy, and keep most of its own
    memory on its node(s).
    """
    from sglang.srt.placement_tools.observe import compare_binding

    if placement.strategy == Strategy.NONE:
        found = []
        if observed.cpus != unbound_cpus:
            found.append(
                f"cpus {format_cpulist(observed.cpus)} observed, the launcher's {format_cpulist(unbound_cpus)} expected for an unbound rank"
            )
        if observed.policy != "default":
            found.append(
                f"memory policy {observed.policy} observed, default expected for an unbound rank"
            )
        return found
    found = compare_binding(placement, observed)
    minimum = MIN_LOCAL_PAGE_RATIO.get(placement.strategy)
    nodes = _target_nodes(placement)
    ratio = observed.local_page_ratio(nodes, anon_only=True) if nodes else None
    bind = placement.mem_policy == MemPolicy.BIND
    if minimum and bind and ratio is not None and ratio < minimum:
        found.append(
            f"{ratio:.1%} of the rank's resident anonymous memory is on node(s) {format_cpulist(nodes)}, at least {minimum:.0%} expected for strategy {placement.strategy}"
        )
    return found


def verify_row(
    placement: ProcessPlacement, report: dict, *, launcher: str, unbound_cpus: frozenset
) -> dict:
    """One output row: the plan's fields, what the rank observed, and whether they agree."""
    from sglang.srt.placement_tools.observe import ObservedBinding

    observed = ObservedBinding.from_dict(report["observed"])
    nodes = _target_nodes(placement)
    found = differences(placement, observed, unbound_cpus=unbound_cpus)
    policy_nodes = format_cpulist(observed.policy_nodes)

    def ratio(**kwargs: bool) -> Optional[float]:
        return observed.local_page_ratio(nodes, **kwargs) if nodes else None

    return {
        **placement.to_dict(),
        "launcher": launcher,
        "observed_pid": report.get("pid"),
        "observed_cpus": format_cpulist(observed.cpus),
        "observed_mems": format_cpulist(observed.mems),
        "observed_policy": f"{observed.policy}:{policy_nodes}".rstrip(":"),
        "local_page_ratio": ratio(anon_only=True),
        "local_page_ratio_all": ratio(),
        "ok": not found,
        "differences": found,
    }


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
    timeout_s: float,
    dp_threads: bool = False,
    configure: Any = None,
) -> list[tuple[RankIdentity, dict]]:
    """Start one probe per local rank as sglang's engine (or, with ``dp_threads``, its
    data-parallel controller) spawns schedulers; return (rank, report) pairs in launch order.
    Every probe ends, or is killed, within ``timeout_s``. ``configure`` replaces
    ``numa_utils.configure_subprocess`` (tests that show verify notices a bypass).
    """
    from sglang.srt.placement.ranks import local_ranks

    if configure is None:
        from sglang.srt.utils import numa_utils

        configure = numa_utils.configure_subprocess
    ctx = multiprocessing.get_context("spawn")
    device = getattr(server_args, "device", "cuda")
    started: list[tuple[RankIdentity, Any, Any]] = []
    lock = threading.Lock()  # the data-parallel controller's env_lock
    errors: list[BaseException] = []

    def spawn(group: list[RankIdentity]) -> None:
        try:
            for rank in group:
                with lock:
                    reader, writer = ctx.Pipe(duplex=False)
                    with _reindexed(rank.gpu_id, device=device) as gpu_id:
                        name = f"verify-{rank.label}"
                        proc = ctx.Process(target=probe_main, args=(writer,), name=name)
                        with configure(server_args, gpu_id):
                            proc.start()
                    writer.close()
                    started.append((rank, proc, reader))
        except BaseException as exc:  # noqa: BLE001 - re-raised by the launching thread
            errors.append(exc)

    ranks = list(local_ranks(server_args))
    groups: dict[int, list[RankIdentity]] = {}
    for rank in ranks:
        groups.setdefault(rank.dp_rank, []).append(rank)
    try:
        if dp_threads:
            threads = [
                threading.Thread(target=spawn, args=(g,)) for g in groups.values()
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        else:
            spawn(ranks)  # from this thread, as the engine does
        if errors:
            raise errors[0]
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
        pending = [(i, *entry) for i, entry in enumerate(started) if i not in reports]
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            who = ", ".join(rank.label for _, rank, _, _ in pending)
            raise PlacementError(
                f"{who}: no report within {timeout_s:g} s (see the rank's output above)"
            )
        waited = [p[3] for p in pending] + [p[2].sentinel for p in pending]
        ready = wait(waited, timeout=remaining)
        for i, rank, proc, reader in pending:
            if not reader.poll() and proc.sentinel not in ready:
                continue
            try:
                report = reader.recv() if reader.poll() else {}
            except EOFError:
                report = {}
            if "observed" not in report:
                proc.join(timeout=1)
                why = report.get("error") or (
                    f"it exited with status {proc.exitcode} before reporting (see its output above)"
                )
                raise PlacementError(f"{rank.label}: the probe rank failed: {why}")
            reports[i] = report
    return [(rank, reports[i]) for i, (rank, _, _) in enumerate(started)]


def verify_mp(
    server_args: Any,
    *,
    timeout_s: float,
    dp_threads: bool = False,
    configure: Any = None,
) -> list[dict]:
    """One row per local rank: what ``plan`` says sglang's spawn does, against what the
    spawned rank observed."""
    from sglang.srt.placement.plan import plan_engine
    from sglang.srt.placement.topology import read_process_affinity

    placements = {p.label: p for p in plan_engine(server_args, launcher="mp")}
    reports = run_mp_probes(
        server_args, timeout_s=timeout_s, dp_threads=dp_threads, configure=configure
    )
    unbound = read_process_affinity().cpus
    return [
        verify_row(placements[rank.label], report, launcher="mp", unbound_cpus=unbound)
        for rank, report in reports
    ]


def format_verify_rows(rows: Sequence[dict]) -> str:
    """One line per rank, in the spirit of Slurm's --cpu-bind=verbose: planned against
    observed, then OK or why not."""
    lines = []
    for row in rows:
        gpu = "" if row.get("gpu_id") is None else f" gpu_id {row['gpu_id']}"
        pci = f" ({row['pci']})" if row.get("pci") else ""
        node = row.get("numa_node")
        ratio = row.get("local_page_ratio")
        head = (
            f"[DP{row['dp_rank']} PP{row['pp_rank']} TP{row['tp_rank']}] {row['launcher']}{gpu}{pci} "
            f"node {'-' if node is None else node} via {row['strategy']}: "
            f"cpus {row['observed_cpus']} (plan {row['cpus'] or 'unbound'}), mems {row['observed_mems']}, "
            f"policy {row['observed_policy']} (plan {row['mem_policy']}:{row['mem_nodes'] or '-'}), "
            f"local pages {'n/a' if ratio is None else f'{ratio:.1%}'}"
        )
        why = "; ".join(row["differences"])
        lines.append(f"{head}: OK" if row["ok"] else f"{head}: MISMATCH: {why}")
    return "\n".join(lines)
