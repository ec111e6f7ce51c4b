"""Ray clusters of fake GPU nodes for the Ray tests: the session's local cluster, and one raylet per node.

``session_cluster`` starts the local cluster every Ray test of a session
shares (``tests/conftest.py::ray_cluster``): 2 CPUs, 4 declared GPUs, and a
fake /sys of three NUMA nodes (``two_numa_nodes``) whose GPUs sit on two of them.

Run as a script (``running_cluster`` does), it holds a multi-node cluster:
python tests/ray_gpu_cluster.py DIR GPUS_OF_NODE_0 [GPUS_OF_NODE_1 ...]
where GPUS_OF_NODE_n is a comma-separated list of GPU numbers (``fakesys.gpu_address``), e.g. ``0,1,2,3``.

Each node's tree (DIR/nodeN) holds this host's allowed CPUs on NUMA node 0
(padded with CPUs this host lacks to 8), a second node of 4 CPUs this host
lacks, and the node's GPUs on node 0, at PCI addresses only that node has. Its
raylet is started with ``fake_host_env`` pointing there and declares as many
GPUs. The script prints one JSON line (address, and per node: id, tree, GPU
PCI addresses), then holds the cluster until its stdin closes, and shuts down
only the nodes it started. Set RAY_TMPDIR to a private directory: a Cluster
records its address there, where a plain ``ray.init()`` of anyone on this
machine would otherwise join it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import fakesys

CPUS_ON_GPU_NODE = 8


def tree_spec(gpus: list[int]) -> fakesys.Host:
    """This host's allowed CPUs (padded to 8) and ``gpus`` on node 0, and a GPU-less node 1 of CPUs it lacks."""
    real = sorted(os.sched_getaffinity(0))
    lacking = itertools.count(max(real) + 1)
    node0 = real + [next(lacking) for _ in range(CPUS_ON_GPU_NODE - len(real))]
    node1 = [next(lacking) for _ in range(4)]
    return fakesys.Host(
        nodes={0: fakesys.NodeSpec(cpus=node0), 1: fakesys.NodeSpec(cpus=node1)},
        pci=[fakesys.host_bridge(0)]
        + [fakesys.PciSpec(fakesys.gpu_address(g), 0) for g in gpus],
    )


def fake_host_env(tree: str) -> dict[str, str]:
    """What makes a raylet's workers see ``tree`` as their host's sysfs, on a CUDA platform (the test harness
    reads these; see tests/harness/sitecustomize.py)."""
    return {"PLACEMENT_TESTS_SYSFS": str(tree), "PLACEMENT_TESTS_PLATFORM": "cuda"}


def main() -> None:
    from ray.cluster_utils import Cluster

    directory, *per_node = sys.argv[1:]
    nodes = [[int(g) for g in spec.split(",")] for spec in per_node]
    trees = [
        str(fakesys.write_sysfs(os.path.join(directory, f"node{i}"), tree_spec(gpus)))
        for i, gpus in enumerate(nodes)
    ]
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "num_gpus": len(nodes[0]),
            "env_vars": fake_host_env(trees[0]),
            "include_dashboard": False,
        },
    )
    try:
        started = [cluster.head_node]
        for gpus, tree in zip(nodes[1:], trees[1:]):
            started.append(
                cluster.add_node(
                    num_cpus=1, num_gpus=len(gpus), env_vars=fake_host_env(tree)
                )
            )
        cluster.wait_for_nodes()
        print(
            json.dumps(
                {
                    "address": cluster.address,
                    "nodes": [
                        {
                            "node_id": node.node_id,
                            "tree": tree,
                            "gpus": [fakesys.gpu_address(g) for g in gpus],
                        }
                        for node, tree, gpus in zip(started, trees, nodes)
                    ],
                }
            ),
            flush=True,
        )
        sys.stdin.read()
    finally:
        cluster.shutdown()


# --------------------------------------------------------------------------- for the tests

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHONPATH = os.pathsep.join([os.path.join(HERE, "harness"), HERE])
"""The tests' helper modules, and the harness that keeps each interpreter from running sglang's own __init__."""
START_TIMEOUT_S = 90.0


def ray_test_env(ray_tmpdir: str) -> dict[str, str]:
    """The environment of a test's Ray processes: this checkout importable, Ray's files under ``ray_tmpdir``,
    no inherited RAY_ADDRESS, and no Ray OOM killer (on a shared machine it reacts to others' memory).
    """
    env = {
        **os.environ,
        "PYTHONPATH": PYTHONPATH,
        "RAY_TMPDIR": ray_tmpdir,
        "RAY_memory_monitor_refresh_ms": "0",
    }
    env.pop("RAY_ADDRESS", None)
    return env


@contextlib.contextmanager
def running_cluster(*gpus_per_node: str) -> Iterator[dict]:
    """Run this script for nodes with ``gpus_per_node`` (e.g. "0,1", "2,3"); yields its JSON plus ``env``, the
    environment under which a driver joins it (RAY_ADDRESS, and the same private RAY_TMPDIR).
    """
    # A short private directory: Ray's socket paths under it must stay within 107 characters.
    directory = tempfile.mkdtemp(prefix="sglr-", dir="/tmp")
    env = ray_test_env(directory)
    holder = subprocess.Popen(
        [
            sys.executable,
            os.path.abspath(__file__),
            os.path.join(directory, "trees"),
            *gpus_per_node,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        ready, _, _ = select.select([holder.stdout], [], [], START_TIMEOUT_S)
        line = holder.stdout.readline() if ready else ""
        if not line:
            holder.kill()
            raise RuntimeError(
                f"the test cluster did not start within {START_TIMEOUT_S:.0f} s: "
                f"{holder.communicate(timeout=30)[1][-3000:]}"
            )
        info = json.loads(line)
        info["env"] = {**env, "RAY_ADDRESS": info["address"]}
        yield info
    finally:
        try:
            holder.communicate(input="", timeout=60)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.communicate()
        shutil.rmtree(directory, ignore_errors=True)


SESSION_GPUS = 4
GPU_NODE = {0: 0, 1: 0, 2: 1, 3: 1}
"""The NUMA node of each GPU of ``two_numa_nodes``."""
NO_CPU_NODE = 2
"""A node of ``two_numa_nodes`` whose CPUs this host lacks: binding to it cannot work here."""


def two_numa_nodes() -> fakesys.Host:
    """Node 0: this host's first allowed CPU (and one it lacks), GPUs 0 and 1; node 1: its second allowed CPU
    (and one it lacks), GPUs 2 and 3; node 2: two CPUs this host lacks and no GPU.

    A GPU's rank binds here with ``--physcpubind`` (no node's CPUs are all allowed), to the real CPU of its
    GPU's node, so a rank placed for the wrong device runs on the wrong CPU.
    """
    real = sorted(os.sched_getaffinity(0))
    if len(real) < 2:
        raise RuntimeError(
            f"the Ray tests need a process allowed on two CPUs, this one has {real}"
        )
    lacking = itertools.count(max(real) + 1)
    nodes = {
        0: fakesys.NodeSpec(cpus=[real[0], next(lacking)]),
        1: fakesys.NodeSpec(cpus=[real[1], next(lacking)]),
        NO_CPU_NODE: fakesys.NodeSpec(cpus=[next(lacking), next(lacking)]),
    }
    gpus = [
        fakesys.PciSpec(fakesys.gpu_address(g), node) for g, node in GPU_NODE.items()
    ]
    return fakesys.Host(nodes=nodes, pci=[fakesys.host_bridge(0), *gpus])


@dataclass(frozen=True)
class SessionCluster:
    """The session's Ray cluster: its raylet's fake /sys, and which real CPU each of its NUMA nodes binds to."""

    tree: Path
    gpus: tuple[str, ...]
    """PCI address of GPU i."""
    node_cpu: dict[int, int]
    """NUMA node -> the one CPU of this host a rank on that node is bound to."""

    def gpu_cpu(self, gpu: int) -> int:
        return self.node_cpu[GPU_NODE[gpu]]


@contextlib.contextmanager
def session_cluster() -> Iterator[SessionCluster]:
    """Start the session's local cluster (``ray.init`` in this process) and shut it down afterwards.

    Its raylet (and so every worker) reads the fake tree (``fake_host_env``), imports the tests' helper
    modules, and builds sglang's stand-in Scheduler (a job setup hook); this process keeps its own environment.
    """
    import ray

    directory = tempfile.mkdtemp(prefix="sglr-", dir="/tmp")
    tree = fakesys.write_sysfs(os.path.join(directory, "sys"), two_numa_nodes())
    real = sorted(os.sched_getaffinity(0))
    overrides = {
        **fake_host_env(tree),
        "PYTHONPATH": os.pathsep.join(
            p for p in (HERE, os.environ.get("PYTHONPATH")) if p
        ),
        "RAY_memory_monitor_refresh_ms": "0",
        "CUDA_VISIBLE_DEVICES": None,
        "RAY_ADDRESS": None,
    }
    before = {name: os.environ.get(name) for name in overrides}
    try:
        for name, value in overrides.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        ray.init(
            address="local",
            num_cpus=2,
            num_gpus=SESSION_GPUS,
            include_dashboard=False,
            configure_logging=False,
            log_to_driver=False,
            _temp_dir=os.path.join(directory, "ray"),
            runtime_env={"worker_process_setup_hook": "upstream_standins.install"},
        )
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    try:
        yield SessionCluster(
            tree=tree,
            gpus=tuple(fakesys.gpu_address(g) for g in GPU_NODE),
            node_cpu={0: real[0], 1: real[1]},
        )
    finally:
        ray.shutdown()
        shutil.rmtree(directory, ignore_errors=True)


def run_json(
    argv: list[str], *, env: dict, timeout: float = 180.0
) -> tuple[int, dict, str]:
    """Run ``argv`` (a Python module or script and its arguments) under ``env``: (exit status, its JSON, stderr)."""
    done = subprocess.run(
        [sys.executable, *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    try:
        return done.returncode, json.loads(done.stdout), done.stderr
    except json.JSONDecodeError:
        raise AssertionError(
            f"{argv} printed no JSON (exit {done.returncode}):\n{done.stdout[-2000:]}\n"
            f"{done.stderr[-4000:]}"
        ) from None


if __name__ == "__main__":
    main()
