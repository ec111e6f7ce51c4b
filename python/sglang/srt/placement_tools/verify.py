"""verify: probe ranks started through sglang's own launch path read their binding back
once sglang's own scheduler set-up has run: each is a real scheduler process (spawned
inside ``configure_subprocess``, running ``run_scheduler_process``; or a Ray
``SchedulerActor``) whose ``Scheduler`` alone is replaced by ``ProbeScheduler``.
``observe_self`` never imports torch, so it also runs in plain interpreters."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import re
import threading
import time
import types
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Iterable, Iterator, Mapping, Optional, Sequence

from sglang.srt.environ import envs
from sglang.srt.placement.cpulist import format_cpulist, parse_cpulist
from sglang.srt.placement.libnuma import read_mempolicy
from sglang.srt.placement.resolve import resolve_placement
from sglang.srt.placement.settings import PlacementPolicy
from sglang.srt.placement.topology import read_process_affinity
from sglang.srt.placement.types import (
    MemPolicy,
    PlacementError,
    ProcessAffinity,
    ProcessPlacement,
    RankIdentity,
    Strategy,
)
from sglang.srt.placement_tools import PlanArgs
from sglang.srt.placement_tools.engine import local_ranks, plan_engine, to_dict

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

_NODE_FIELD = re.compile(r"^N(\d+)=(\d+)$")
_PROC_SELF = "/proc/self"
# Share of a rank's own (anonymous) resident memory that must sit on its bound node(s):
# in-process migrates what was touched before binding, and a few pages may stay behind.
MIN_LOCAL_PAGE_RATIO = {"exec": 0.99, "in-process": 0.95}
Started = tuple[RankIdentity, BaseProcess, Connection]


@dataclass(frozen=True)
class ObservedBinding:
    cpus: frozenset[int]
    mems: frozenset[int]  # nodes it may allocate from at all (Mems_allowed_list)
    policy: str  # as get_mempolicy names it: "default", "bind", "preferred", ...
    policy_nodes: frozenset[int]
    resident_kb: tuple[tuple[int, int], ...] = ()  # (node, kB on it), every mapping
    anon_kb: tuple[tuple[int, int], ...] = ()  # the same, anonymous mappings only

    def local_page_ratio(
        self, nodes: Iterable[int], *, anon_only: bool = False
    ) -> Optional[float]:
        """Share of resident memory on ``nodes``; None if nothing or no node counts."""
        counts = self.anon_kb if anon_only else self.resident_kb
        total = sum(kb for _, kb in counts)
        wanted = frozenset(nodes)
        on_nodes = sum(kb for n, kb in counts if n in wanted)
        return on_nodes / total if total and wanted else None

    def to_dict(self) -> dict[str, object]:
        return {
            "cpus": format_cpulist(self.cpus),
            "mems": format_cpulist(self.mems),
            "policy": self.policy,
            "policy_nodes": format_cpulist(self.policy_nodes),
            "resident_kb": {str(node): kb for node, kb in self.resident_kb},
            "anon_kb": {str(node): kb for node, kb in self.anon_kb},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> "ObservedBinding":
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


def observe_self() -> ObservedBinding:
    """This process's binding as the kernel sees it."""
    allowed = read_process_affinity(os.path.join(_PROC_SELF, "status"))
    try:
        with open(os.path.join(_PROC_SELF, "numa_maps"), errors="replace") as f:
            resident, anon = parse_numa_maps(f.read())
    except FileNotFoundError:  # a kernel built without CONFIG_NUMA: nothing to count
        resident, anon = {}, {}
    try:
        policy, policy_nodes = read_mempolicy()
    except OSError:  # no libnuma.so.1, or a kernel without NUMA: nothing reads it
        policy, policy_nodes = "unknown", frozenset()
    kb = (tuple(sorted(counts.items())) for counts in (resident, anon))
    return ObservedBinding(allowed.cpus, allowed.mems, policy, policy_nodes, *kb)


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


# A model config sglang's publish() resolves the probe's ServerArgs against; it is in
# the package, so each Ray node's install holds it too.
PROBE_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "probe_model")


def probe_server_args(server_args: PlanArgs, *, verbose: bool) -> "ServerArgs":
    """sglang's ServerArgs with ``server_args``' fields, for the probe model; the
    probe ranks log errors only unless ``verbose``."""
    from sglang.srt.server_args import ServerArgs

    fields = {
        f.name: getattr(server_args, f.name) for f in dataclasses.fields(PlanArgs)
    }
    level = "info" if verbose else "error"
    return ServerArgs(model_path=PROBE_MODEL, log_level=level, **fields)


class ProbeScheduler:
    """Stands in for sglang's ``Scheduler``, built where it would be (after
    ``configure_scheduler_process``): it reads the rank's binding and loads nothing.
    It never raises (``run_scheduler_process`` would signal its parent)."""

    def __init__(self, server_args: "ServerArgs", port_args: object = None) -> None:
        self.async_d2h_worker = None
        self.gracefully_exit = False
        self.metrics_reporter = types.SimpleNamespace(_shutdown_fpm=lambda: None)
        try:
            self.info = self._observe(server_args)
        except Exception as exc:  # noqa: BLE001 - reported, never raised
            self.info = {"pid": os.getpid(), "error": f"{type(exc).__name__}: {exc}"}

    @staticmethod
    def _observe(server_args: "ServerArgs") -> dict:
        from sglang.srt.runtime_context import get_device
        from sglang.srt.utils import numa_utils

        threads = {}  # /proc/self/status shows the main thread's CPUs only
        for tid in filter(str.isdigit, os.listdir("/proc/self/task")):
            with contextlib.suppress(PlacementError, ValueError):  # it exited
                status = read_process_affinity(f"/proc/self/task/{tid}/status")
                threads[int(tid)] = format_cpulist(status.cpus)
        info = {
            "pid": os.getpid(),
            "observed": observe_self().to_dict(),
            "thread_cpus": threads,
            "device_gpu_id": get_device().gpu_id,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }
        gpus = numa_utils.ray_actor_gpus()
        if gpus is not None:  # the plan the actor bound itself by
            import ray

            context = ray.get_runtime_context()
            gpu_id = int(gpus[0]) if gpus else get_device().gpu_id
            info["placement"] = to_dict(_actor_plan(server_args, gpu_id))
            info.update(
                node_id=context.get_node_id(),
                actor=context.get_actor_name(),
                accelerator_ids=gpus,
                # What a worker of this node gets when nothing binds it: its raylet's.
                unbound_cpus=format_cpulist(os.sched_getaffinity(os.getppid())),
            )
        return info

    def get_init_info(self) -> dict:
        return self.info

    def run_event_loop(self) -> None:
        return None


def _before_bind(server_args: "ServerArgs") -> object:
    """This host as a Ray actor saw it before it bound itself: its raylet's CPUs."""
    from sglang.srt.utils import numa_utils

    class BeforeBind(numa_utils.LiveHost):
        def affinity(self) -> ProcessAffinity:
            parent = read_process_affinity(f"/proc/{os.getppid()}/status")
            return dataclasses.replace(parent, source="the raylet")

    return BeforeBind(server_args, report_failures=False)


def _actor_plan(server_args: "ServerArgs", gpu_id: int) -> ProcessPlacement:
    """What the actor's configure step decided (the launcher tells its ranks)."""
    from sglang.srt.utils import numa_utils

    launcher, gpu = numa_utils.launched_rank(server_args, gpu_id)
    policy = PlacementPolicy.from_env(server_args, launcher=launcher)
    rank = RankIdentity(gpu)
    return resolve_placement(rank=rank, policy=policy, host=_before_bind(server_args))


def install_probe_scheduler() -> None:
    """The probe in place of sglang's ``Scheduler`` in this process (a Ray job's
    ``worker_process_setup_hook``, a spawned probe rank)."""
    import sglang.srt.managers.scheduler as scheduler

    scheduler.Scheduler = ProbeScheduler


def probe_scheduler_process(*args: object) -> None:
    """A probe rank's target: sglang's own ``run_scheduler_process`` with the probe as
    its Scheduler; it reports through the pipe, as a scheduler does."""
    if getattr(args[0], "log_level", None) == "error":  # quiet: errors only
        warnings.filterwarnings("ignore")
        logging.disable(logging.WARNING)
    install_probe_scheduler()
    from sglang.srt.managers.scheduler import run_scheduler_process

    run_scheduler_process(*args)


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
    placement: ProcessPlacement,
    report: dict,
    *,
    launcher: str,
    unbound_cpus: frozenset[int],
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
    if device != "cuda" or not envs.SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS.get():
        yield gpu_id
        return
    from sglang.srt.utils.common import maybe_reindex_device_id

    with maybe_reindex_device_id(gpu_id) as reindexed:
        yield reindexed


def run_mp_probes(
    server_args: PlanArgs,
    *,
    timeout_s: float,
    dp_threads: bool = False,
    verbose: bool = False,
) -> list[tuple[RankIdentity, dict]]:
    """(rank, report) per local rank, spawned as sglang's engine (or with
    ``dp_threads`` its data-parallel controller) spawns schedulers."""
    from sglang.srt.utils import numa_utils

    ctx = multiprocessing.get_context("spawn")
    lock = threading.Lock()  # the data-parallel controller's env_lock
    started: list[Started] = []
    sglang_args = probe_server_args(server_args, verbose=verbose)

    def spawn(group: Sequence[RankIdentity]) -> None:
        for rank in group:
            with lock:
                reader, writer = ctx.Pipe(duplex=False)
                index = rank.device.index
                with _reindexed(index, device=server_args.device) as gpu_id:
                    name = f"verify-{rank.label}"
                    ranks = (rank.tp_rank, rank.pp_rank, rank.dp_rank)
                    proc = ctx.Process(
                        target=probe_scheduler_process,
                        args=(sglang_args, None, gpu_id, *ranks, writer),
                        name=name,
                    )
                    with numa_utils.configure_subprocess(sglang_args, gpu_id):
                        proc.start()
                writer.close()
                started.append((rank, proc, reader))

    ranks, dp_size = local_ranks(server_args), server_args.dp_size
    try:
        if dp_threads:  # each dp rank's group from a thread of its own, all at once
            groups = [[r for r in ranks if r.dp_rank == dp] for dp in range(dp_size)]
            with ThreadPoolExecutor(len(groups)) as pool:
                list(pool.map(spawn, groups))  # the first error, once all have run
        else:
            spawn(ranks)  # from this thread, as the engine does
        return _collect(started, timeout_s=timeout_s)
    finally:
        for _, proc, reader in started:
            reader.close()
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()


def _collect(
    started: Sequence[Started], *, timeout_s: float
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
            report = reader.recv()
        except EOFError:
            proc.join(timeout=1)
            raise PlacementError(
                f"{rank.label}: the probe rank exited with status {proc.exitcode} "
                "before reporting (see its output above)"
            ) from None
        if "error" in report:
            raise PlacementError(f"{rank.label}: the probe failed: {report['error']}")
        reports.append((rank, report))
    return reports


def verify_mp(
    server_args: PlanArgs,
    *,
    timeout_s: float,
    dp_threads: bool = False,
    verbose: bool = False,
) -> list[dict]:
    """A row per local rank: what ``plan`` says sglang's spawn does, and what it did."""
    placements = {p.label: p for p in plan_engine(server_args, launcher="mp")}
    reports = run_mp_probes(
        server_args, timeout_s=timeout_s, dp_threads=dp_threads, verbose=verbose
    )
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
