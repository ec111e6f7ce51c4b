"""A local Ray cluster of several raylets on a fake two-node GPU host, and sglang's own
scheduler actors on it; for tests/test_ray_actors.py.

``run_plan(plan)`` runs this script inside a mount namespace whose /sys is the fake
host (``tests/fakehost.py``), so that the whole cluster (GCS, every raylet, every
worker) reads it::

    python tests/ray_gpu_cluster.py cluster < PLAN.json

The host (``two_node_host``): NUMA node 0 holds this machine's first allowed CPU, a
CPU it lacks and GPUs 0 and 1; node 1 its second allowed CPU, a CPU it lacks and
GPUs 2 and 3. A rank bound to a node therefore runs on that node's one real CPU, so
a rank placed by the wrong GPU runs on the wrong CPU. Only node 0 has memory here.

The script starts ``ray.cluster_utils.Cluster`` with one raylet per entry of
``plan["raylets"]`` (the first is the head): its declared GPUs, its environment (the
GPUs the stand-in NVML lists, its CUDA_VISIBLE_DEVICES) and a resource
``raylet_<name>`` that pins a bundle to it. It then runs every job of the plan at
once (one after another with ``"concurrent": false``), each in a driver of its own
(``python tests/ray_gpu_cluster.py job``) on the sglang package the job names (the
overlaid one, or ``.venv/pristine``), and prints one JSON line: each job's actor
reports, and timings. A job connects with its own
``runtime_env`` (its settings, its PYTHONPATH, ``ray_scheduler_standin``'s setup
hook), reserves one placement group with a bundle per raylet it uses (all or nothing,
so jobs waiting for the same GPUs queue instead of deadlocking), creates its actors
with sglang's own ``_create_scheduler_actor`` (``ray_upstream``: the function, not
the engine module, which imports the whole model stack), collects each ``get_info``
(or the error), then kills its actors and removes its group. Ray's files go under
RAY_TMPDIR, a private directory the caller makes; the script shuts its cluster down
itself (cluster.shutdown), and stops nothing it did not start.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

HERE = Path(__file__).resolve().parent
HARNESS = HERE / "harness"
FAKES = HERE / "fakes"
TINY_MODEL = str(HERE / "data" / "tiny_llama")
PRISTINE = Path(
    os.environ.get("SGLANG_PRISTINE_DIR") or HERE.parent / ".venv" / "pristine"
)
SETUP_HOOK = "ray_scheduler_standin.install"
GPU_NODE = {0: 0, 1: 0, 2: 1, 3: 1}
"""The NUMA node of host GPU i."""
DEADLINE_S = int(os.environ.get("RAY_GPU_CLUSTER_DEADLINE_S", "420"))
"""The script's own limit: past it, it shuts its cluster down and fails."""
OBJECT_STORE_BYTES = 80 * 1024 * 1024


def two_node_host(real_cpus: list[int]) -> Any:
    import fakesys

    if len(real_cpus) < 2:
        raise RuntimeError(
            f"the Ray tests need a process allowed on two CPUs, this one has {real_cpus}"
        )
    lacking = max(real_cpus) + 1
    nodes = {
        node: fakesys.NodeSpec(cpus=[real_cpus[node], lacking + node])
        for node in (0, 1)
    }
    gpus = [fakesys.PciSpec(fakesys.gpu_address(g), n) for g, n in GPU_NODE.items()]
    return fakesys.Host(nodes=nodes, pci=[fakesys.host_bridge(0), *gpus])


def nvml_gpus(gpus: list[int]) -> str:
    """FAKE_NVML_GPUS for a raylet whose NVML lists host GPUs ``gpus``, in this order."""
    import fakesys

    return ",".join(fakesys.gpu_address(g) for g in gpus)


def pythonpath(package: str) -> str:
    """The path of a process on ``package`` ("overlaid" or "pristine") with the test
    harness: the stand-in NVML first, sglang without its __init__, these helpers."""
    paths = [str(FAKES), str(HARNESS), str(HERE)]
    if package == "pristine":
        paths.insert(0, str(PRISTINE))
    elif package != "overlaid":
        raise ValueError(f"package {package!r}: expected 'overlaid' or 'pristine'")
    return os.pathsep.join(paths)


# --------------------------------------------------------------------- a job's driver


def run_job(job: dict) -> list[dict]:
    """One job: its placement group, its actors, their reports (or errors); nothing
    of it is left in the cluster afterwards."""
    import ray
    import sglang_light
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray_upstream import functions_from_source

    from sglang.srt.server_args import ServerArgs

    sglang_light.bare_package("sglang.srt.ray")  # its __init__ imports the engine
    engine = functions_from_source(
        "sglang.srt.ray.engine", ("_create_scheduler_actor",)
    )
    env_vars = {**job.get("env_vars", {}), "PYTHONPATH": pythonpath(job["package"])}
    ray.init(
        address=os.environ["RAY_ADDRESS"],
        runtime_env={"worker_process_setup_hook": SETUP_HOOK, "env_vars": env_vars},
        configure_logging=False,
        log_to_driver=False,
    )
    try:
        raylets = sorted({a["raylet"] for a in job["actors"]})
        bundles = [
            {"GPU": sum(a["raylet"] == r for a in job["actors"]), f"raylet_{r}": 1}
            for r in raylets
        ]
        pg = placement_group(bundles, strategy="PACK")
        ray.get(pg.ready(), timeout=DEADLINE_S)
        actors = []
        try:
            for spec in job["actors"]:
                actors.append(
                    engine._create_scheduler_actor(
                        pg=pg,
                        bundle_idx=raylets.index(spec["raylet"]),
                        gpu_id=0,  # RayEngine's for a custom group; Ray picks the GPU
                        server_args=ServerArgs(
                            model_path=TINY_MODEL, **job["server_args"]
                        ),
                        port_args=None,
                        tp_rank=spec["tp_rank"],
                        pp_rank=0,
                        dp_rank=0,
                        dist_init_addr="127.0.0.1:29999",
                        rank0_node_ip="127.0.0.1",
                    )
                )
            reports = []
            for spec, actor in zip(job["actors"], actors):
                try:
                    info = ray.get(actor.get_info.remote(), timeout=DEADLINE_S)
                except ray.exceptions.RayError as exc:  # the test judges it
                    info = {"error": str(exc)}
                reports.append({**spec, **info})
            return reports
        finally:
            for actor in actors:
                ray.kill(actor)
            remove_placement_group(pg)
    finally:
        ray.shutdown()


def job_main() -> None:
    started = time.monotonic()
    reports = run_job(json.loads(sys.stdin.read()))
    print(json.dumps({"reports": reports, "seconds": time.monotonic() - started}))


# ------------------------------------------------------------------ the cluster holder


def _raylet_args(raylet: dict) -> dict:
    # No CPUs: actors and bundles ask none, and a raylet starts no idle worker for
    # CPU tasks (about 2 s of CPU each, for nothing).
    return {
        "num_cpus": 0,
        "num_gpus": raylet["num_gpus"],
        "resources": {f"raylet_{raylet['name']}": 100},
        "env_vars": raylet["env"],
        "object_store_memory": OBJECT_STORE_BYTES,
    }


def _drive(job: dict, *, address: str, started: list) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": pythonpath(job["package"]),
        "RAY_ADDRESS": address,
    }
    driver = subprocess.Popen(
        [sys.executable, __file__, "job"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    started.append(driver)
    out, err = driver.communicate(json.dumps(job))
    if driver.returncode != 0 or not out.strip():
        raise RuntimeError(
            f"the driver of job {job['name']!r} failed ({driver.returncode}): "
            f"{err[-4000:]}"
        )
    return json.loads(out.strip().splitlines()[-1])


def namespace_cpu_s() -> float:
    """CPU seconds of the processes in this mount namespace (the cluster's), with
    those of the children they reaped: what the plan cost, for the timings."""
    ours, ticks, total = os.readlink("/proc/self/ns/mnt"), os.sysconf("SC_CLK_TCK"), 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/ns/mnt") == ours:
                with open(f"/proc/{pid}/stat") as stat:
                    fields = stat.read().rpartition(")")[2].split()
                total += sum(int(f) for f in fields[11:15])  # utime .. cstime
    return total / ticks


def _deadline(signum: int, frame: Any) -> None:
    raise TimeoutError(f"ray_gpu_cluster.py: the plan ran past {DEADLINE_S} s")


def cluster_main() -> None:
    from ray.cluster_utils import Cluster

    plan = json.loads(sys.stdin.read())
    signal.signal(signal.SIGALRM, _deadline)
    signal.alarm(DEADLINE_S)
    started = time.monotonic()
    head, *others = plan["raylets"]
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            **_raylet_args(head),
            "include_dashboard": False,
            # Nor workers for each job as its driver connects, which would run the
            # job's setup hook (seconds of CPU each) and never host an actor.
            "_system_config": {"prestart_worker_first_driver": False},
        },
    )
    drivers: list[subprocess.Popen] = []
    try:
        for raylet in others:
            cluster.add_node(**_raylet_args(raylet))
        cluster.wait_for_nodes()
        cluster_s = time.monotonic() - started
        # At once unless the plan says otherwise (a benchmark times one at a time).
        workers = len(plan["jobs"]) if plan.get("concurrent", True) else 1
        with ThreadPoolExecutor(max_workers=workers) as pool:
            runs = {
                job["name"]: pool.submit(
                    _drive, job, address=cluster.address, started=drivers
                )
                for job in plan["jobs"]
            }
            try:
                done = {name: run.result() for name, run in runs.items()}
            finally:
                for driver in drivers:  # on the deadline, or another job's failure
                    if driver.poll() is None:
                        driver.kill()
        print(
            json.dumps(
                {
                    "jobs": {name: d["reports"] for name, d in done.items()},
                    "timings": {
                        "cluster_s": cluster_s,
                        "jobs_s": time.monotonic() - started - cluster_s,
                        "job_s": {name: d["seconds"] for name, d in done.items()},
                        "cpu_s": namespace_cpu_s(),
                    },
                }
            ),
            flush=True,
        )
    finally:
        signal.alarm(0)
        cluster.shutdown()


# ----------------------------------------------------------------------- for the tests


@contextlib.contextmanager
def private_ray_tmpdir() -> Iterator[str]:
    """A directory of this process's own for Ray's files (short: Ray's socket paths
    must stay within 107 characters), removed afterwards."""
    directory = Path(tempfile.mkdtemp(prefix="sglr-", dir="/tmp"))
    try:
        yield str(directory)
    finally:
        if directory.parent == Path("/tmp") and directory.name.startswith("sglr-"):
            shutil.rmtree(directory, ignore_errors=True)


def run_plan(plan: dict) -> dict:
    """Run ``plan`` on a fresh cluster on the fake host (``cluster_main``): its JSON."""
    import fakehost

    with private_ray_tmpdir() as ray_tmpdir:
        env = {
            "PYTHONPATH": pythonpath("overlaid"),
            "RAY_TMPDIR": ray_tmpdir,
            # Ray's OOM killer reacts to other users' memory on a shared machine.
            "RAY_memory_monitor_refresh_ms": "0",
            "RAY_ADDRESS": "",
        }
        done = fakehost.run(
            two_node_host(sorted(os.sched_getaffinity(0))),
            [sys.executable, __file__, "cluster"],
            env=env,
            timeout=DEADLINE_S + 60,
            input=json.dumps(plan),
        )
    if done.returncode != 0 or not done.stdout.strip():
        raise AssertionError(
            f"the Ray plan failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n"
            f"{done.stderr[-6000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    commands = {"cluster": cluster_main, "job": job_main}
    if sys.argv[1:] not in ([c] for c in commands):
        raise SystemExit(f"usage: {sys.argv[0]} cluster|job < JSON")
    commands[sys.argv[1]]()
