"""verify: probe ranks started exactly as sglang starts schedulers read their binding
back once sglang's own set-up has run. A spawned rank runs ``run_scheduler_process``
inside ``numa_utils.configure_subprocess``; a Ray rank is sglang's ``SchedulerActor``
made by RayEngine's ``_create_scheduler_actor``. Only their ``Scheduler`` is
``ProbeScheduler``, which loads no model."""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
import types
from typing import Optional

from sglang.srt.placement_tools.plan import (
    Rank,
    format_cpulist,
    gpu_pci,
    node_ranks,
    parse_cpulist,
    plan_index,
    who,
)

logger = logging.getLogger(__name__)

# sglang's settings, read where each rank runs: handed to the Ray job's workers.
ENGINE_VARS = (
    "SGLANG_NUMA_BIND_V2 SGLANG_AUTO_NUMA_BIND SGLANG_CRASH_ON_NUMA_BIND_FAILURE "
    "SGLANG_SET_CPU_AFFINITY SGLANG_CPU_OMP_THREADS_BIND "
    "SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS PYTHONWARNINGS"
).split()
PROBE_HOOK = "sglang.srt.placement_tools.verify.install_probe"
_SCHEDULER = "sglang.srt.managers.scheduler"
# A spawned rank under numactl's --membind touches its pages there from the start.
MIN_SHARE = 0.99
_POLICIES = dict(enumerate("default preferred bind interleave local".split()))
_TRUE = ("1", "true", "yes")
_MAX_NODES = 1024


class ProbeError(RuntimeError):
    """A probe rank did not report: verify exits 1."""


# ------------------------------------------------------------- inside each rank


def mempolicy() -> str:
    """This thread's memory policy as ``bind:0``, ``preferred:1`` or ``default``."""
    from sglang.srt.utils.numa_utils import get_libnuma

    libnuma = get_libnuma()
    if libnuma is None:
        return "unknown"
    mode, bits = ctypes.c_int(), 8 * ctypes.sizeof(ctypes.c_ulong)
    mask = (ctypes.c_ulong * (_MAX_NODES // bits))()
    if libnuma.get_mempolicy(ctypes.byref(mode), mask, _MAX_NODES, None, 0) != 0:
        return "unknown"
    nodes = [n for n in range(_MAX_NODES) if mask[n // bits] >> (n % bits) & 1]
    name = _POLICIES.get(mode.value & 0xFF, str(mode.value))
    return f"{name}:{format_cpulist(nodes)}" if name != "default" else name


def anon_pages() -> dict[int, int]:
    """kB of this process's anonymous resident memory per node (numa_maps)."""
    counts: dict[int, int] = {}
    try:
        with open("/proc/self/numa_maps") as f:
            lines = f.read().splitlines()
    except OSError:  # a kernel without NUMA
        return counts
    for line in lines:
        fields = line.split()[2:]
        if any(f.startswith("file=") for f in fields):
            continue
        page = next((f[18:] for f in fields if f.startswith("kernelpagesize_kB=")), 4)
        for field in fields:
            if field[:1] == "N" and "=" in field and field[1:].split("=")[0].isdigit():
                node, pages = field[1:].split("=")
                counts[int(node)] = counts.get(int(node), 0) + int(pages) * int(page)
    return counts


def observe(server_args) -> dict:
    """This rank's binding as the kernel sees it, and the GPU it will drive."""
    from sglang.srt.runtime_context import get_device

    threads = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            threads[tid] = format_cpulist(os.sched_getaffinity(int(tid)))
        except OSError:  # it exited
            pass
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            status[key] = value.strip()
    gpu_id = get_device().gpu_id
    cuda = server_args.device == "cuda"
    return {
        "pid": os.getpid(),
        "cpus": status.get("Cpus_allowed_list", ""),
        "mems": status.get("Mems_allowed_list", ""),
        "policy": mempolicy(),
        "pages_kb": anon_pages(),
        "thread_cpus": threads,
        "device_gpu_id": gpu_id,
        "pci": gpu_pci(gpu_id) if cuda else None,
    }


def _probe(server_args) -> dict:
    info = observe(server_args)
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():  # a Ray actor: plan it here
        ids = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
        ray_id = int(ids[0]) if ids else info["device_gpu_id"]
        # Planned as the actor was before it bound itself: on its raylet's CPUs.
        unbound = os.sched_getaffinity(os.getppid())
        os.sched_setaffinity(0, unbound)
        rank = Rank(0, 0, 0, ray_id)
        info["plan"] = plan_index(server_args, rank, ray_id, launcher="ray")
        info["unbound_cpus"] = format_cpulist(unbound)
        info["node_id"] = ray.get_runtime_context().get_node_id()
    return info


class ProbeScheduler:
    """Stands in for sglang's ``Scheduler`` where it is built, after
    ``configure_scheduler_process``: it reads the rank's binding and loads nothing."""

    def __init__(self, server_args, port_args=None, **_):
        self.async_d2h_worker = None
        self.gracefully_exit = False
        self.metrics_reporter = types.SimpleNamespace(_shutdown_fpm=lambda: None)
        try:
            self.info = _probe(server_args)
        except Exception as e:  # reported, never raised (the parent would be signalled)
            self.info = {"error": f"{type(e).__name__}: {e}"}

    def get_init_info(self) -> dict:
        return self.info

    def run_event_loop(self) -> None:
        return None


def install_probe() -> None:
    """The probe in place of sglang's Scheduler in this process, once the scheduler
    module is imported (a spawned probe rank, or a Ray worker: the job's
    ``worker_process_setup_hook``, which runs in its task workers too)."""
    module = sys.modules.get(_SCHEDULER)
    if module is not None:
        module.Scheduler = ProbeScheduler
    elif not any(isinstance(finder, _ProbeFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _ProbeFinder())


class _ProbeFinder:
    def find_spec(self, name, path, target=None):
        if name != _SCHEDULER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module) -> None:
            load(module)
            module.Scheduler = ProbeScheduler

        spec.loader.exec_module = exec_module
        return spec


def probe_rank(*args) -> None:
    """A spawned probe rank: sglang's own ``run_scheduler_process``; quiet (errors
    only) unless verify runs with -v."""
    if args[0].log_level == "error":
        logging.disable(logging.WARNING)
    install_probe()
    from sglang.srt.managers.scheduler import run_scheduler_process

    run_scheduler_process(*args)


# ------------------------------------------------------------------ comparison


def compare(plan: dict, seen: dict, *, unbound: str) -> dict:
    """The plan's row with what its rank observed, and every way they differ."""
    if "error" in seen:
        raise ProbeError(f"[{_label(plan)}] the probe failed: {seen['error']}")
    found, cpus, nodes = [], plan["cpus"], plan["mem_nodes"]
    policy = f"{plan['mem_policy']}:{nodes}" if plan["mem_policy"] != "none" else None
    if plan["strategy"] == "none":  # left as launched, unless sglang's own slice
        blind = os.environ.get("SGLANG_SET_CPU_AFFINITY", "").lower() in _TRUE
        cpus, policy = "" if blind else unbound, "default"
    off = {tid: c for tid, c in seen["thread_cpus"].items() if cpus and c != cpus}
    if cpus and seen["cpus"] != cpus:
        found.append(f"cpus {seen['cpus']} observed, {cpus} planned")
    elif off:
        tid, other = next(iter(off.items()))
        found.append(f"{len(off)} thread(s) outside the planned CPUs ({tid}: {other})")
    if policy and seen["policy"] != policy:
        found.append(f"policy {seen['policy']} observed, {policy} planned")
    wanted = parse_cpulist(nodes, what="mem_nodes") if nodes else set()
    if not wanted <= parse_cpulist(seen["mems"] or "0", what="Mems_allowed"):
        found.append(f"Mems_allowed {seen['mems']} lacks node(s) {nodes}")
    total = sum(seen["pages_kb"].values())
    local = sum(kb for n, kb in seen["pages_kb"].items() if int(n) in wanted)
    share = local / total if total and wanted else None
    if plan["mem_policy"] == "bind" and share is not None and share < MIN_SHARE:
        found.append(f"{share:.1%} of its pages on node(s) {nodes}")
    if plan["pci"] != seen["pci"]:
        found.append(f"GPU {seen['pci']} observed, {plan['pci']} planned")
    return {
        **plan,
        "observed_cpus": seen["cpus"],
        "observed_mems": seen["mems"],
        "observed_policy": seen["policy"],
        "observed_pci": seen["pci"],
        "observed_gpu_id": seen["device_gpu_id"],
        "thread_cpus": seen["thread_cpus"],
        "local_page_share": share,
        "ok": not found,
        "differences": found,
    }


def _label(row: dict) -> str:
    return f"DP{row['dp_rank']} PP{row['pp_rank']} TP{row['tp_rank']}"


def format_verify_row(row: dict) -> str:
    share = row["local_page_share"]
    head = (
        f"[{_label(row)}] {row['launcher']} {who(row, ray=False)} node "
        f"{'-' if row['numa_node'] is None else row['numa_node']} via "
        f"{row['strategy']}: cpus {row['observed_cpus']} (plan "
        f"{row['cpus'] or 'unbound'}), mems {row['observed_mems']}, policy "
        f"{row['observed_policy']} (plan {row['mem_policy']}:"
        f"{row['mem_nodes'] or '-'}), local pages "
        f"{'n/a' if share is None else f'{share:.1%}'}"
    )
    return (
        f"{head}: OK"
        if row["ok"]
        else f"{head}: MISMATCH: " + "; ".join(row["differences"])
    )


# ------------------------------------------------------------------ launchers


def _receive(reader, proc, label: str, deadline: float, timeout: float) -> dict:
    if not reader.poll(max(0.0, deadline - time.monotonic())):
        raise ProbeError(f"[{label}] no report within {timeout:g} s")
    try:
        return reader.recv()
    except EOFError:
        proc.join(timeout=5)
        raise ProbeError(
            f"[{label}] the probe rank exited with status {proc.exitcode} before "
            "reporting (run with -v to see its output)"
        ) from None


def verify_mp(args, server_args, *, timeout: float) -> list[dict]:
    """Each rank of this node spawned as sglang's engine (or its data-parallel
    controller) spawns a scheduler: from this thread, in launch order."""
    import multiprocessing as mp
    from multiprocessing import resource_tracker

    from sglang.srt.utils import numa_utils
    from sglang.srt.utils.common import maybe_reindex_device_id

    mp.set_start_method("spawn", force=True)  # as sglang's engine sets it
    # Started now, not by the first spawn: that would run it through the rank's
    # numactl wrapper, which removes itself, so the rank's own exec could miss it.
    resource_tracker.ensure_running()
    unbound = format_cpulist(os.sched_getaffinity(0))
    deadline, started = time.monotonic() + timeout, []
    try:
        for rank in node_ranks(args, args.node_rank):
            reader, writer = mp.Pipe(duplex=False)
            with maybe_reindex_device_id(rank.gpu_id) as gpu_id:
                plan = plan_index(server_args, rank, gpu_id, launcher="mp")
                dp = rank.dp_rank if args.dp_size > 1 else None
                ranks = (gpu_id, rank.tp_rank, rank.pp_rank, dp, writer)
                proc = mp.Process(target=probe_rank, args=(server_args, None, *ranks))
                with numa_utils.configure_subprocess(server_args, gpu_id):
                    proc.start()
            writer.close()
            started.append((rank, plan, proc, reader))
        return [
            compare(
                plan, _receive(r, p, rank.label, deadline, timeout), unbound=unbound
            )
            for rank, plan, p, r in started
        ]
    finally:
        for _, _, proc, reader in started:
            reader.close()
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()


def _connect(args, ranks: int, *, verbose: bool) -> Optional[str]:
    """Join RAY_ADDRESS's cluster, else start a local one in a private directory
    (returned, for removal); the job's workers get the probe and sglang's settings."""
    import ray

    env = {name: os.environ[name] for name in ENGINE_VARS if name in os.environ}
    options = dict(
        configure_logging=False,
        log_to_driver=verbose,
        runtime_env={"worker_process_setup_hook": PROBE_HOOK, "env_vars": env},
    )
    logging.getLogger("ray").setLevel(logging.INFO if verbose else logging.ERROR)
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if address:
        ray.init(address=address, **options)
        return None
    if args.device == "cpu":  # RayEngine asks one GPU per actor whatever the device
        gpus = ranks
    else:
        import torch

        gpus = torch.cuda.device_count()
    if gpus < ranks:
        raise ProbeError(
            f"RayEngine asks one GPU per rank ({ranks}); this host has {gpus}: join "
            "a cluster that has them (RAY_ADDRESS)"
        )
    directory = tempfile.mkdtemp(prefix="sglang-verify-")
    os.environ["RAY_TMPDIR"] = directory
    for knob in ("RAY_enable_worker_prestart", "RAY_prestart_worker_first_driver"):
        os.environ.setdefault(knob, "0")  # a worker for each actor, no idle ones
    try:
        ray.init(
            address="local",
            num_cpus=max(len(os.sched_getaffinity(0)), 1),
            num_gpus=gpus,
            include_dashboard=False,
            _temp_dir=os.path.join(directory, "ray"),
            **options,
        )
    except BaseException:
        _remove(directory)
        raise
    return directory


def _remove(directory: Optional[str]) -> None:
    """The private directory ``_connect`` made, if it made one."""
    os.environ.pop("RAY_TMPDIR", None)
    if directory and os.path.basename(directory).startswith("sglang-verify-"):
        shutil.rmtree(directory, ignore_errors=True)


def verify_ray(args, server_args, *, timeout: float, verbose: bool) -> list[dict]:
    """Each rank as RayEngine starts it when it has no placement group: one bundle
    of {CPU: 1, GPU: ranks per node} per node, the driver's first, and
    ``_create_scheduler_actor`` for every rank of each node in turn."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from sglang.srt.ray import engine

    per_node = [node_ranks(args, node, ray=True) for node in range(args.nnodes)]
    total = sum(len(ranks) for ranks in per_node)
    directory = _connect(args, total, verbose=verbose)
    actors, pg = [], None
    try:
        bundles = [{"CPU": 1, "GPU": total // args.nnodes}] * args.nnodes
        strategy = "STRICT_PACK" if args.nnodes == 1 else "SPREAD"
        pg = placement_group(bundles, strategy=strategy)
        if not ray.wait([pg.ready()], timeout=timeout)[0]:
            raise ProbeError(
                f"RayEngine's placement group {bundles} ({strategy}) was not ready "
                f"within {timeout:g} s; the cluster has {ray.cluster_resources()} "
                "(RayEngine asks one GPU per rank, on --device cpu too)"
            )
        first, ip = engine._find_engine_bundle(pg, args.nnodes)
        order = [first] + [i for i in range(args.nnodes) if i != first]
        local = total // args.nnodes // args.dp_size  # GPUs of one dp rank per node
        shared = dict(pg=pg, server_args=server_args, port_args=None, rank0_node_ip=ip)
        shared["dist_init_addr"] = f"{ip}:0"  # the probe makes no process group
        for dp in range(args.dp_size):
            for node, ranks in enumerate(per_node):
                for rank in (r for r in ranks if r.dp_rank == dp):
                    actor = engine._create_scheduler_actor(
                        bundle_idx=order[node],
                        gpu_id=rank.gpu_id % local,
                        tp_rank=rank.tp_rank,
                        pp_rank=rank.pp_rank,
                        dp_rank=rank.dp_rank,
                        **shared,
                    )
                    actors.append((rank, actor))
        refs = [actor.get_info.remote() for _, actor in actors]
        deadline, rows = time.monotonic() + timeout, []
        for (rank, _), ref in zip(actors, refs):
            left = max(0.0, deadline - time.monotonic())
            try:
                seen = ray.get(ref, timeout=left)
            except ray.exceptions.GetTimeoutError:
                raise ProbeError(f"[{rank.label}] no report within {timeout:g} s")
            except ray.exceptions.RayError as e:
                last = str(e).strip().splitlines()[-1:]
                raise ProbeError(f"[{rank.label}] the actor failed: {last}") from None
            if "error" in seen:
                raise ProbeError(f"[{rank.label}] the probe failed: {seen['error']}")
            ranks = dict(dp_rank=rank.dp_rank, pp_rank=rank.pp_rank)
            plan = {**seen["plan"], **ranks, "tp_rank": rank.tp_rank}
            rows.append(compare(plan, seen, unbound=seen["unbound_cpus"]))
        return rows
    finally:
        for rank, actor in actors:
            ray.kill(actor, no_restart=True)
        if pg is not None:
            remove_placement_group(pg)
        ray.shutdown()
        _remove(directory)
