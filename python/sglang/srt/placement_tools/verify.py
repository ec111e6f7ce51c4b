"""verify: probe ranks started through sglang's own launch path read their binding back;
``observe_self`` never imports torch, so it also runs in plain interpreters."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

from sglang.srt.placement import settings
from sglang.srt.placement.cpulist import format_cpulist, parse_cpulist
from sglang.srt.placement.libnuma import read_mempolicy
from sglang.srt.placement.topology import read_process_affinity
from sglang.srt.placement.types import (
    MemPolicy,
    PlacementError,
    ProcessPlacement,
    RankIdentity,
    Strategy,
)
from sglang.srt.placement_tools.engine import to_dict  # noqa: E402

_NODE_FIELD = re.compile(r"^N(\d+)=(\d+)$")


@dataclass(frozen=True)
class ObservedBinding:
    cpus: frozenset[int]
    mems: frozenset[int]
    """Nodes the process may allocate from at all (``Mems_allowed_list``)."""
    policy: str
    """As get_mempolicy names it: "default", "bind", "preferred", "interleave", ..."""
    policy_nodes: frozenset[int]
    resident_kb: tuple[tuple[int, int], ...] = ()
    """(node, kB resident on it) over every mapping, sorted by node."""
    anon_kb: tuple[tuple[int, int], ...] = ()

    def local_page_ratio(
        self, nodes: Iterable[int], *, anon_only: bool = False
    ) -> Optional[float]:
        """Share of resident memory on ``nodes``; None if nothing or no node counts."""
        counts = self.anon_kb if anon_only else self.resident_kb
        total = sum(kb for _, kb in counts)
        wanted = frozenset(nodes)
        on_nodes = sum(kb for n, kb in counts if n in wanted)
        return on_nodes / total if total and wanted else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "cpus": format_cpulist(self.cpus),
            "mems": format_cpulist(self.mems),
            "policy": self.policy,
            "policy_nodes": format_cpulist(self.policy_nodes),
            "resident_kb": {str(node): kb for node, kb in self.resident_kb},
            "anon_kb": {str(node): kb for node, kb in self.anon_kb},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ObservedBinding":
        def counts(key: str) -> tuple[tuple[int, int], ...]:
            return tuple(
                sorted((int(n), int(kb)) for n, kb in data.get(key, {}).items())
            )

        return cls(
            cpus=parse_cpulist(data["cpus"]),
            mems=parse_cpulist(data["mems"]),
            policy=data["policy"],
            policy_nodes=parse_cpulist(data["policy_nodes"]),
            resident_kb=counts("resident_kb"),
            anon_kb=counts("anon_kb"),
        )


def parse_numa_maps(text: str) -> tuple[dict[int, int], dict[int, int]]:
    """kB resident per node over every mapping, and over anonymous ones only."""
    resident: dict[int, int] = {}
    anon: dict[int, int] = {}
    for line in text.splitlines():
        fields = line.split()[2:]
        page_kb = 4
        for item in fields:
            if item.startswith("kernelpagesize_kB="):
                page_kb = int(item.split("=", 1)[1])
        is_file = any(item.startswith("file=") for item in fields)
        for match in filter(None, map(_NODE_FIELD.match, fields)):
            node, kb = int(match[1]), int(match[2]) * page_kb
            resident[node] = resident.get(node, 0) + kb
            if not is_file:
                anon[node] = anon.get(node, 0) + kb
    return resident, anon


def observe_self(
    *,
    proc_root: str = "/proc",
    mempolicy: Optional[Callable[[], "tuple[str, frozenset[int]]"]] = None,
) -> ObservedBinding:
    """This process's binding as the kernel sees it (tests replace both readers)."""
    base = os.path.join(proc_root, "self")
    allowed = read_process_affinity(os.path.join(base, "status"))
    try:
        with open(os.path.join(base, "numa_maps"), errors="replace") as f:
            resident, anon = parse_numa_maps(f.read())
    except FileNotFoundError:
        # Kernels built without CONFIG_NUMA have no numa_maps: nothing to count.
        resident, anon = {}, {}
    try:
        policy, policy_nodes = (mempolicy or read_mempolicy)()
    except OSError:  # no libnuma.so.1, or a kernel without NUMA: nothing reads it
        policy, policy_nodes = "unknown", frozenset()
    return ObservedBinding(
        cpus=allowed.cpus,
        mems=allowed.mems,
        policy=policy,
        policy_nodes=policy_nodes,
        resident_kb=tuple(sorted(resident.items())),
        anon_kb=tuple(sorted(anon.items())),
    )


def compare_binding(
    placement: ProcessPlacement, observed: ObservedBinding
) -> list[str]:
    """One line per way ``observed`` differs from ``placement``. A policy stricter than
    planned (bind for preferred) counts: it can fail allocations meant to spill over."""
    if placement.strategy == Strategy.NONE:
        return []
    diffs: list[str] = []
    if placement.cpus and observed.cpus != placement.cpus:
        diffs.append(
            f"cpus {_fmt(observed.cpus)} observed, {_fmt(placement.cpus)} planned"
        )
    if placement.mem_policy == MemPolicy.NONE:
        return diffs
    want_nodes, want_policies = placement.mem_nodes, ("bind",)
    if placement.mem_policy != MemPolicy.BIND:
        want_policies = ("preferred", "preferred_many")
        if placement.numa_node is not None:
            want_nodes = frozenset([placement.numa_node])
    if not want_nodes <= observed.mems:
        diffs.append(
            f"mems allowed {_fmt(observed.mems)} observed, must include "
            f"{_fmt(want_nodes)} (a cpuset or an outer numactl restricts this process)"
        )
    if observed.policy not in want_policies or observed.policy_nodes != want_nodes:
        seen = _policy_text(observed.policy, observed.policy_nodes)
        planned = _policy_text(placement.mem_policy, want_nodes)
        diffs.append(f"memory policy {seen} observed, {planned} planned")
    return diffs


def _fmt(values: frozenset[int]) -> str:
    return format_cpulist(values) or "(none)"


def _policy_text(policy: str, nodes: frozenset[int]) -> str:
    return f"{policy} on node(s) {format_cpulist(nodes)}" if nodes else policy


# Share of a rank's own (anonymous) resident memory that must sit on its bound node(s):
# in-process migrates what was touched before binding, and a few pages may stay behind.
MIN_LOCAL_PAGE_RATIO = {"exec": 0.99, "in-process": 0.95}


def probe_main(writer: Any) -> None:
    """A probe rank's target; a failure shows as an exit before reporting."""
    writer.send({"pid": os.getpid(), "observed": observe_self().to_dict()})


def _target_nodes(placement: ProcessPlacement) -> frozenset[int]:
    if placement.strategy == Strategy.NONE:
        return frozenset()
    if placement.mem_nodes or placement.numa_node is None:
        return placement.mem_nodes
    return frozenset([placement.numa_node])


def differences(
    placement: ProcessPlacement,
    observed: ObservedBinding,
    *,
    unbound_cpus: frozenset[int],
) -> list[str]:
    """An unbound rank must have been left alone; a bound one must also keep most of
    its own memory on its node(s)."""
    if placement.strategy == Strategy.NONE:
        found = []
        if observed.cpus != unbound_cpus:
            found.append(
                f"cpus {format_cpulist(observed.cpus)} observed, the launcher's "
                f"{format_cpulist(unbound_cpus)} expected for an unbound rank"
            )
        if observed.policy != "default":
            found.append(
                f"memory policy {observed.policy} observed, "
                "default expected for an unbound rank"
            )
        return found
    found = compare_binding(placement, observed)
    minimum = MIN_LOCAL_PAGE_RATIO.get(placement.strategy)
    nodes = _target_nodes(placement)
    ratio = observed.local_page_ratio(nodes, anon_only=True)
    bind = placement.mem_policy == MemPolicy.BIND
    if minimum and bind and ratio is not None and ratio < minimum:
        found.append(
            f"{ratio:.1%} of the rank's resident anonymous memory is on node(s) "
            f"{format_cpulist(nodes)}, at least {minimum:.0%} expected for strategy "
            f"{placement.strategy}"
        )
    return found


def verify_row(
    placement: ProcessPlacement, report: dict, *, launcher: str, unbound_cpus: frozenset
) -> dict:
    """The plan's fields, what the rank observed, and whether they agree."""
    observed = ObservedBinding.from_dict(report["observed"])
    nodes = _target_nodes(placement)
    found = differences(placement, observed, unbound_cpus=unbound_cpus)
    policy_nodes = format_cpulist(observed.policy_nodes)
    return {
        **to_dict(placement),
        "launcher": launcher,
        "observed_pid": report.get("pid"),
        "observed_cpus": format_cpulist(observed.cpus),
        "observed_mems": format_cpulist(observed.mems),
        "observed_policy": f"{observed.policy}:{policy_nodes}".rstrip(":"),
        "local_page_ratio": observed.local_page_ratio(nodes, anon_only=True),
        "local_page_ratio_all": observed.local_page_ratio(nodes),
        "ok": not found,
        "differences": found,
    }


@contextlib.contextmanager
def _reindexed(gpu_id: int, *, device: str) -> Iterator[int]:
    """sglang's ``maybe_reindex_device_id`` for CUDA ranks, as the engine applies it."""
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
    """(rank, report) per local rank, spawned as sglang's engine (or its data-parallel
    controller) spawns schedulers; tests of a bypass replace ``configure``."""
    from sglang.srt.placement_tools.engine import local_ranks

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
    try:
        if dp_threads:
            groups: dict[int, list[RankIdentity]] = {}
            for rank in ranks:
                groups.setdefault(rank.dp_rank, []).append(rank)
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
    deadline = time.monotonic() + timeout_s
    reports = []
    for rank, proc, reader in started:
        # The launcher holds no writer: a probe that exits is EOF, which poll() sees.
        if not reader.poll(max(0.0, deadline - time.monotonic())):
            raise PlacementError(
                f"{rank.label}: no report within {timeout_s:g} s "
                "(see the rank's output above)"
            )
        try:
            reports.append((rank, reader.recv()))
        except EOFError:
            proc.join(timeout=1)
            raise PlacementError(
                f"{rank.label}: the probe rank exited with status {proc.exitcode} "
                "before reporting (see its output above)"
            ) from None
    return reports


def verify_mp(server_args: Any, **probe_args: Any) -> list[dict]:
    """A row per local rank: what ``plan`` says sglang's spawn does, and what it did."""
    from sglang.srt.placement_tools.engine import plan_engine

    placements = {p.label: p for p in plan_engine(server_args, launcher="mp")}
    reports = run_mp_probes(server_args, **probe_args)
    unbound = read_process_affinity().cpus
    return [
        verify_row(placements[rank.label], report, launcher="mp", unbound_cpus=unbound)
        for rank, report in reports
    ]


def format_verify_rows(rows: Sequence[dict]) -> str:
    """One line per rank, as Slurm's --cpu-bind=verbose: plan, observed, OK or why."""
    lines = []
    for row in rows:
        gpu = "" if row.get("gpu_id") is None else f" gpu_id {row['gpu_id']}"
        pci = f" ({row['pci']})" if row.get("pci") else ""
        node = row.get("numa_node")
        ratio = row.get("local_page_ratio")
        head = (
            f"[DP{row['dp_rank']} PP{row['pp_rank']} TP{row['tp_rank']}] "
            f"{row['launcher']}{gpu}{pci} "
            f"node {'-' if node is None else node} via {row['strategy']}: "
            f"cpus {row['observed_cpus']} (plan {row['cpus'] or 'unbound'}), "
            f"mems {row['observed_mems']}, policy {row['observed_policy']} "
            f"(plan {row['mem_policy']}:{row['mem_nodes'] or '-'}), "
            f"local pages {'n/a' if ratio is None else f'{ratio:.1%}'}"
        )
        why = "; ".join(row["differences"])
        lines.append(f"{head}: OK" if row["ok"] else f"{head}: MISMATCH: {why}")
    return "\n".join(lines)
