"""sglang 0.5.23's own callers and behaviours, driven against the overlaid package.

Each test calls the project the way an upstream module does (the same function,
the same arguments, a real ``ServerArgs``) or checks one behaviour of 0.5.23
that callers and operators rely on.
"""

from __future__ import annotations

import ast
import ctypes
import importlib
import multiprocessing
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import fakesys
import pytest
import shm_kernel_standin as kernel
from conftest import full_import_env
from spawn_support import use_fake_host, without_numactl

from sglang.srt.environ import envs

PACKAGE = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])

# scripts/setup.sh keeps the package as installed, before the overlay, beside the environment.
PRISTINE = (
    Path(
        os.environ.get("SGLANG_PRISTINE_DIR")
        or Path(__file__).resolve().parents[1] / ".venv" / "pristine"
    )
    / "sglang"
)
CHANGED_MODULES = (
    "sglang.srt.utils.numa_utils",
    "sglang.srt.ray.scheduler_actor",
    "sglang.srt.distributed.bootstrap",
    "sglang.srt.ray.engine",
    "sglang.srt.environ",
)


def server_args(**kwargs):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(model_path="/nonexistent", **kwargs)


def two_node_tree(root: Path) -> Path:
    """Node 0 is this host's real node 0 (its CPUs); node 1 and its GPU exist only in the tree."""
    real_cpus = frozenset(os.sched_getaffinity(0))
    spare = frozenset(range(max(real_cpus) + 1, max(real_cpus) + 3))
    return fakesys.write_sysfs(
        root,
        fakesys.Host(
            nodes={
                0: fakesys.NodeSpec(cpus=real_cpus),
                1: fakesys.NodeSpec(cpus=spare),
            },
            pci=[
                fakesys.host_bridge(0),
                fakesys.PciSpec(fakesys.gpu_address(0), 0),
                fakesys.PciSpec(fakesys.gpu_address(1), 1),
            ],
        ),
    )


def report_memory_policy(queue) -> None:
    from sglang.srt.placement.libnuma import read_mempolicy

    policy, nodes = read_mempolicy()
    queue.put((policy, sorted(nodes), sorted(os.sched_getaffinity(0))))


def start_inside_configure_subprocess(args, gpu_id: int):
    """What entrypoints/engine.py does for each scheduler: ``proc.start()`` inside configure_subprocess."""
    from sglang.srt.utils import numa_utils

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=report_memory_policy, args=(queue,))
    with numa_utils.configure_subprocess(args, gpu_id):
        proc.start()
    try:
        return queue.get(timeout=120)
    finally:
        proc.join(30)


# --------------------------------------------------------------------------- configure_subprocess


def test_spawned_child_of_configure_subprocess_runs_under_its_gpus_placement(
    tmp_path, monkeypatch
):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    use_fake_host(monkeypatch, two_node_tree(tmp_path / "sys"))
    policy, nodes, _ = start_inside_configure_subprocess(
        server_args(tp_size=2, device="cuda"), 0
    )
    assert (policy, nodes) == (
        "bind",
        [0],
    )  # numactl --cpunodebind=0 --membind=0 started the child


@pytest.mark.parametrize(
    "case", ["one NUMA node", "no numactl", "bind v1", "cpu device, bind v1"]
)
def test_configure_subprocess_is_a_no_op_where_upstream_is_one(
    case, tmp_path, monkeypatch
):
    """(A CPU-device rank is placed on purpose, unlike upstream; SGLANG_NUMA_BIND_V2=0 is the way back.)"""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    device = "cuda"
    if case.startswith("cpu device"):
        device = "cpu"
    if case != "one NUMA node":
        use_fake_host(monkeypatch, two_node_tree(tmp_path / "sys"))
    if case == "no numactl":
        without_numactl(monkeypatch)
    if case.endswith("bind v1"):
        monkeypatch.setenv("SGLANG_NUMA_BIND_V2", "0")
    policy, _, cpus = start_inside_configure_subprocess(
        server_args(tp_size=2, device=device), 0
    )
    assert policy == "default" and cpus == sorted(os.sched_getaffinity(0))


def test_get_numa_node_if_available_needs_only_numa_node():
    from sglang.srt.utils.numa_utils import get_numa_node_if_available

    assert get_numa_node_if_available(types.SimpleNamespace(numa_node=[1, 0]), 1) == 0
    assert get_numa_node_if_available(server_args(numa_node=[0, 1]), 1) == 1


def test_gpu_worker_binds_through_the_placement():
    """multimodal_gen's GPU worker: get_numa_node_if_available(server_args=, gpu_id=), then numa_bind_to_node.

    In a child process: the bind changes the memory policy of the process that makes it.
    """
    code = (
        "import os, types\n"
        "from sglang.multimodal_gen.runtime.managers import gpu_worker\n"
        "from sglang.srt.placement.libnuma import read_mempolicy\n"
        "from sglang.srt.server_args import ServerArgs\n"
        "before = sorted(os.sched_getaffinity(0))\n"
        "node = gpu_worker._bind_worker_to_gpu_numa_node(types.SimpleNamespace(numa_node=[0]), 0)\n"
        "policy, nodes = read_mempolicy()\n"
        "unplaced = gpu_worker._bind_worker_to_gpu_numa_node(ServerArgs(model_path='/x', device='cuda'), 0)\n"
        "print(node, policy, sorted(nodes), sorted(os.sched_getaffinity(0)) == before, unplaced)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # --numa-node 0: bound to node 0's CPUs (all of them here), preferring its memory; without --numa-node,
    # discovery on this one-node host binds nothing, as upstream.
    assert out.stdout.split("\n")[-2] == "0 preferred [0] True None"


# --------------------------------------------------------------------------- numa_bind_to_node, get_libnuma


def test_numa_bind_to_node_intersects_with_the_current_affinity():
    from sglang.srt.utils.numa_utils import numa_bind_to_node

    before = os.sched_getaffinity(0)
    first = min(before)
    code = (
        "import os\n"
        f"os.sched_setaffinity(0, {{{first}}})\n"
        "from sglang.srt.utils.numa_utils import numa_bind_to_node\n"
        "numa_bind_to_node(0)\n"
        "print(sorted(os.sched_getaffinity(0)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"[{first}]"  # not widened to the whole node
    assert callable(numa_bind_to_node)


def test_numa_bind_to_node_of_a_missing_node_follows_the_failure_policy(caplog):
    from sglang.srt.utils.numa_utils import numa_bind_to_node

    numa_bind_to_node(63)  # a warning, as upstream, not an OSError
    assert any("NUMA node 63" in r.getMessage() for r in caplog.records)
    with envs.SGLANG_CRASH_ON_NUMA_BIND_FAILURE.override(True), pytest.raises(
        RuntimeError, match="NUMA node 63"
    ):
        numa_bind_to_node(63)


def test_get_libnuma_is_a_cdll_or_none(monkeypatch):
    from sglang.srt.placement import libnuma
    from sglang.srt.utils.numa_utils import get_libnuma

    assert isinstance(get_libnuma(), ctypes.CDLL)
    monkeypatch.setattr(libnuma, "LIBRARY", "libnuma-absent.so.1")
    libnuma.load_libnuma.cache_clear()
    try:
        assert get_libnuma() is None
    finally:
        libnuma.load_libnuma.cache_clear()


# --------------------------------------------------------------------------- init_threads_binding


def test_init_threads_binding_all_leaves_smt_siblings_out(tmp_path, monkeypatch):
    from sglang.srt.utils.numa_utils import init_threads_binding

    real = sorted(os.sched_getaffinity(0))
    # One core per CPU pair: CPUs 0 and 1 are SMT siblings of core 0 on node 0.
    host = fakesys.Host(
        nodes={0: fakesys.NodeSpec(cpus=frozenset(real))},
        cores={cpu: (0, 0) for cpu in real},
    )
    use_fake_host(monkeypatch, fakesys.write_sysfs(tmp_path / "sys", host))
    with envs.SGLANG_CPU_OMP_THREADS_BIND.override("all"):
        assert init_threads_binding(numa_index=0, world_size=1) == str(real[0])


# --------------------------------------------------------------------------- environment values


@pytest.mark.parametrize(
    "text, value",
    [("y", True), ("YES", True), ("1", True), ("n", False), ("false", False)],
)
def test_boolean_settings_take_upstreams_spellings(text, value, monkeypatch):
    from sglang.srt.placement import settings

    monkeypatch.setenv("SGLANG_NUMA_BIND_V2", text)
    assert settings.bind_v2() is value


def test_an_invalid_boolean_warns_and_keeps_the_default(monkeypatch):
    from sglang.srt.placement import settings

    monkeypatch.setenv("SGLANG_CRASH_ON_NUMA_BIND_FAILURE", "maybe")
    with pytest.warns(UserWarning, match="SGLANG_CRASH_ON_NUMA_BIND_FAILURE"):
        assert settings.bind_failure_is_fatal() is False


# --------------------------------------------------------------------------- bootstrap's CPU path


@pytest.mark.parametrize("schema", ["released", "group"])
@pytest.mark.parametrize("pp_rank", [0, 1])
def test_bootstrap_cpu_path_hands_the_kernel_an_explicit_namespace(
    schema, pp_rank, monkeypatch
):
    from sglang.srt.distributed import bootstrap
    from sglang.srt.distributed import shm_collective
    from sglang.srt.distributed.shm_collective import ShmNamespace, unlink_shm_segments

    port = 40000 + os.getpid() % 20000
    method = f"tcp://127.0.0.1:{port}"
    namespace = ShmNamespace.from_init_method(method, pp_rank=pp_rank)
    monkeypatch.setattr(bootstrap, "_is_cpu_amx_available", True)
    parallel = types.SimpleNamespace(tp_size=1, tp_rank=0, pp_rank=pp_rank)
    monkeypatch.setattr(bootstrap, "get_parallel", lambda: parallel)
    for name in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    environ_before = dict(os.environ)
    affinity_before = os.sched_getaffinity(0)
    with kernel.registered(schema, threads_env=True) as calls:
        try:
            bootstrap._init_cpu_threads_env(
                local_omp_cpuid=str(min(affinity_before)), dist_init_method=method
            )
            initialize = [dict(c) for c in calls if c.get("op") == "initialize"]
        finally:
            unlink_shm_segments()
            os.sched_setaffinity(0, affinity_before)
    if schema == "released":
        assert initialize and initialize[0]["segment"] == namespace.segment_name(0)
    else:  # joined once sglang's TP group exists (finish_shm_collective)
        assert initialize == [] and shm_collective._GROUPS[0][1] == namespace
        shm_collective._GROUPS.clear()
    # What parallel_state reads afterwards is what upstream sets; MASTER_ADDR/PORT are untouched.
    assert dict(os.environ) == {**environ_before, "LOCAL_SIZE": "1"}
    assert kernel.c_getenv("LOCAL_SIZE") == "1"
    assert all(kernel.c_getenv(name) is None for name in ("MASTER_ADDR", "MASTER_PORT"))


# --------------------------------------------------------------------------- imports upstream relies on


def _imported_names(path: Path) -> list[tuple[str, str]]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        return []
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.level != 0:
            continue
        for alias in node.names:
            if node.module in CHANGED_MODULES and alias.name != "*":
                found.append((node.module, alias.name))
            elif (
                f"{node.module}.{alias.name}" in CHANGED_MODULES
            ):  # from sglang.srt.utils import numa_utils
                found.append((f"{node.module}.{alias.name}", ""))
    return found


def test_every_name_upstream_imports_from_a_changed_module_still_resolves():
    assert (
        PRISTINE / "srt"
    ).is_dir(), f"SGLANG_PRISTINE_DIR must hold the pristine package (got {PRISTINE})"
    wanted = sorted(
        {pair for path in PRISTINE.rglob("*.py") for pair in _imported_names(path)}
    )
    for expected in [
        ("sglang.srt.utils.numa_utils", "numa_bind_to_node"),
        ("sglang.srt.utils.numa_utils", "get_numa_node_if_available"),
        ("sglang.srt.utils.numa_utils", ""),
        ("sglang.srt.ray.scheduler_actor", "SchedulerActor"),
        ("sglang.srt.ray.engine", "_create_scheduler_actor"),
    ]:
        assert expected in wanted, expected
    missing = []
    for module_name, name in wanted:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(module_name)
        if name and not hasattr(module, name):
            missing.append(f"{module_name}.{name}")
    assert missing == []


def test_sglang_router_imports_its_launch_server_from_the_overlaid_package():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sglang_router.launch_server, sglang\nprint(sglang.__file__)",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=full_import_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().startswith(str(PACKAGE))


# --------------------------------------------------------------------------- Ray actors as RayEngine creates them
@pytest.mark.ray
def test_scheduler_actors_created_as_ray_engine_creates_them_bind_to_their_gpus_node(
    ray_cluster,
):
    """RayEngine's own placement group (one bundle of the node's GPUs: GPUs 0 and 1, on
    NUMA node 0 of the session cluster's fake /sys) and upstream's unchanged
    ``_create_scheduler_actor`` call per rank, with a real ServerArgs; the actors bind
    themselves, then build sglang's stand-in Scheduler (``upstream_standins``)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from sglang.srt.ray.engine import _create_scheduler_actor

    args = server_args(tp_size=2, device="cuda")
    pg = placement_group([{"CPU": 1, "GPU": 2}], strategy="STRICT_PACK")
    actors = []
    try:
        ray.get(pg.ready(), timeout=120)
        for tp_rank in range(2):
            actors.append(
                _create_scheduler_actor(
                    pg=pg,
                    bundle_idx=0,
                    gpu_id=tp_rank,
                    server_args=args,
                    port_args=None,
                    tp_rank=tp_rank,
                    pp_rank=0,
                    dp_rank=0,
                    dist_init_addr="127.0.0.1:29999",
                    rank0_node_ip="127.0.0.1",
                )
            )
        infos = ray.get([a.get_info.remote() for a in actors], timeout=300)
        ray.get([a.run_event_loop.remote() for a in actors], timeout=60)
        names = sorted(
            n for n in ray.util.list_named_actors() if n.startswith("sglang_scheduler")
        )
    finally:
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(pg)
    # Each actor built the stand-in Scheduler for its GPU, after upstream's configure step.
    assert sorted(i["cuda_visible_devices"] for i in infos) == ["0", "1"]
    assert all(i["configured_gpu_id"] == int(i["cuda_visible_devices"]) for i in infos)
    assert {i["model_path"] for i in infos} == {"/nonexistent"}
    # Both GPUs are on node 0: each actor bound every thread there, memory too.
    cpu = ray_cluster.node_cpu[0]
    assert [(i["cpus"], i["policy"], i["policy_nodes"]) for i in infos] == [
        ([cpu], "bind", [0])
    ] * 2
    assert [i["thread_cpu_sets"] for i in infos] == [[(cpu,)]] * 2
    assert len(names) == 2 and all(
        "_dp0_pp0_tp" in n and "_bundle0" in n for n in names
    )
