"""Two engines x TP 2 on one host: real spawned processes, real gloo groups, real /dev/shm."""

from __future__ import annotations

import multiprocessing
import os
import socket

import pytest

import bootstrap_children
from sglang.srt.distributed.shm_collective import ShmNamespace


def _free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in ports:
            ports.append(port)
    return ports


def collect_results(processes, queue) -> list[dict]:
    """One report per started child; every child joined (or killed); no child may report an error."""
    try:
        results = [queue.get(timeout=120) for _ in processes]
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, "\n".join(errors)
    return results


@pytest.mark.parametrize("schema", ["released", "namespaced"])
def test_two_engines_tp2_never_share_segments(monkeypatch, schema):
    engine_ports = _free_ports(3)
    inherited_port = engine_ports.pop()
    # What a launcher (or a user's shell) leaves behind: every rank inherits it.
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(inherited_port))
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    cpus = sorted(os.sched_getaffinity(0))

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    processes = []
    for engine in (0, 1):
        for rank in (0, 1):
            cpu = cpus[(2 * engine + rank) % len(cpus)]
            process = context.Process(
                target=bootstrap_children.engine_rank,
                args=(engine, rank, engine_ports[engine], schema, cpu, queue),
            )
            process.start()
            processes.append(process)
    results = collect_results(processes, queue)
    assert all(process.exitcode == 0 for process in processes)

    by_key = {(r["engine"], r["rank"]): r for r in results}
    segments = {key: r["segment"] for key, r in by_key.items()}
    assert len(set(segments.values())) == 4
    for (engine, rank), result in by_key.items():
        expected = ShmNamespace(addr="127.0.0.1", port=engine_ports[engine]).segment_name(rank)
        assert result["segment"] == expected
        # The kernel used exactly this name, and its peers are its own engine's.
        [call] = [c for c in result["calls"] if c["op"] == "initialize"]
        assert call["segment"] == expected
        assert call["schema"] == schema
        assert set(result["peer_prefixes"].values()) == {result["prefix"]}
        assert result["segment_mode"] == 0o600
        assert result["shm_collective"] is True
        # One gloo allreduce and one shared-memory sum per engine.
        expected_sum = (1 + 10 * engine) + (2 + 10 * engine)
        assert result["allreduce"] == expected_sum
        assert result["shm_sum"] == expected_sum
        # The environment each process started with is what it ends with.
        assert result["env_same"] and result["c_env_same"]
        assert result["c_master_port"] == str(inherited_port)
        # Every thread runs on the rank's CPU.
        cpu = cpus[(2 * engine + rank) % len(cpus)]
        assert result["bound_cpus"] == str(cpu)
        assert set(map(tuple, result["affinities"].values())) == {(cpu,)}
        assert result["num_threads"] == 1
        assert any(
            line.startswith("INFO rank ") and f"CPUs {cpu} " in line and "numa_index=0" in line
            and "world_size=2" in line
            for line in result["logs"]
        )
        assert result["released"] == [expected]
        assert result["segment_after_release"] is False
    if schema == "released":
        for result in by_key.values():
            [call] = [c for c in result["calls"] if c["op"] == "initialize"]
            assert call["env"] == {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(engine_ports[result["engine"]]),
                "LOCAL_SIZE": "2",
            }


def test_pipeline_stages_of_one_engine_get_their_own_segments(monkeypatch):
    """TP 1 x PP 2: both stages are TP rank 0 of the same address, yet share nothing."""
    [port] = _free_ports(1)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    cpus = sorted(os.sched_getaffinity(0))
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    processes = [
        context.Process(
            target=bootstrap_children.engine_rank,
            args=(0, rank, port, "released", cpus[rank % len(cpus)], queue),
            kwargs={"tp_size": 1, "world_size": 2},
        )
        for rank in (0, 1)
    ]
    for process in processes:
        process.start()
    results = collect_results(processes, queue)
    by_rank = {r["rank"]: r for r in results}
    base = ShmNamespace(addr="127.0.0.1", port=port)
    assert by_rank[0]["segment"] == base.segment_name(0)
    assert by_rank[1]["segment"] == base.for_stage(1).segment_name(0)
    for rank, result in by_rank.items():
        assert result["allreduce"] == 3.0
        assert result["shm_sum"] == rank + 1
        assert result["peer_prefixes"] == {0: result["prefix"]}
        assert result["env_same"] and result["c_env_same"]
