"""Holds a Ray cluster of fake GPU nodes for the GPU-path tests: one raylet per node, each with its own sysfs tree.

Run (``running_cluster`` does): python tests/ray_gpu_cluster.py DIR GPUS_OF_NODE_0 [GPUS_OF_NODE_1 ...]
where GPUS_OF_NODE_n is a comma-separated list of GPU numbers (``fakesys.gpu_address``), e.g. ``0,1,2,3``.

Each node's tree (DIR/nodeN) holds this host's allowed CPUs on NUMA node 0
(padded with CPUs this host lacks to 8), a second node of 4 CPUs this host
lacks, and the node's GPUs on node 0, at PCI addresses only that node has. Its
raylet is started with SGLANG_SYSFS_ROOT pointing there and declares as many
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
        pci=[fakesys.host_bridge(0)] + [fakesys.PciSpec(fakesys.gpu_address(g), 0) for g in gpus],
    )


def main() -> None:
    from ray.cluster_utils import Cluster

    directory, *per_node = sys.argv[1:]
    nodes = [[int(g) for g in spec.split(",")] for spec in per_node]
    trees = [str(fakesys.write_sysfs(os.path.join(directory, f"node{i}"), tree_spec(gpus)))
             for i, gpus in enumerate(nodes)]
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "num_gpus": len(nodes[0]), "env_vars": {"SGLANG_SYSFS_ROOT": trees[0]},
        "include_dashboard": False,
    })
    try:
        started = [cluster.head_node]
        for gpus, tree in zip(nodes[1:], trees[1:]):
            started.append(cluster.add_node(num_cpus=1, num_gpus=len(gpus), env_vars={"SGLANG_SYSFS_ROOT": tree}))
        cluster.wait_for_nodes()
        print(json.dumps({
            "address": cluster.address,
            "nodes": [{"node_id": node.node_id, "tree": tree, "gpus": [fakesys.gpu_address(g) for g in gpus]}
                      for node, tree, gpus in zip(started, trees, nodes)],
        }), flush=True)
        sys.stdin.read()
    finally:
        cluster.shutdown()


# --------------------------------------------------------------------------- for the tests

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHONPATH = os.pathsep.join([os.path.join(os.path.dirname(HERE), "python"), HERE])
START_TIMEOUT_S = 90.0


def ray_test_env(ray_tmpdir: str) -> dict[str, str]:
    """The environment of a test's Ray processes: this checkout importable, Ray's files under ``ray_tmpdir``,
    no inherited RAY_ADDRESS, and no Ray OOM killer (on a shared machine it reacts to others' memory)."""
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "RAY_TMPDIR": ray_tmpdir, "RAY_memory_monitor_refresh_ms": "0"}
    env.pop("RAY_ADDRESS", None)
    return env


@contextlib.contextmanager
def running_cluster(*gpus_per_node: str) -> Iterator[dict]:
    """Run this script for nodes with ``gpus_per_node`` (e.g. "0,1", "2,3"); yields its JSON plus ``env``, the
    environment under which a driver joins it (RAY_ADDRESS, and the same private RAY_TMPDIR)."""
    # A short private directory: Ray's socket paths under it must stay within 107 characters.
    directory = tempfile.mkdtemp(prefix="sglr-", dir="/tmp")
    env = ray_test_env(directory)
    holder = subprocess.Popen([sys.executable, os.path.abspath(__file__), os.path.join(directory, "trees"),
                               *gpus_per_node], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
    try:
        ready, _, _ = select.select([holder.stdout], [], [], START_TIMEOUT_S)
        line = holder.stdout.readline() if ready else ""
        if not line:
            holder.kill()
            raise RuntimeError(f"the test cluster did not start within {START_TIMEOUT_S:.0f} s: "
                               f"{holder.communicate(timeout=30)[1][-3000:]}")
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


def run_json(argv: list[str], *, env: dict, timeout: float = 180.0) -> tuple[int, dict, str]:
    """Run ``argv`` (a Python module or script and its arguments) under ``env``: (exit status, its JSON, stderr)."""
    done = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout)
    try:
        return done.returncode, json.loads(done.stdout), done.stderr
    except json.JSONDecodeError:
        raise AssertionError(f"{argv} printed no JSON (exit {done.returncode}):\n{done.stdout[-2000:]}\n"
                             f"{done.stderr[-4000:]}") from None


if __name__ == "__main__":
    main()
