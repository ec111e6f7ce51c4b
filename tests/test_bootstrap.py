"""The CPU shared-memory all-reduce's segments, through sglang's real bootstrap.

Two co-located CPU engines, a TP 2 one and a TP 1 x PP 2 one, whose every rank
inherits the same ``MASTER_ADDR``/``MASTER_PORT`` (as a job launcher, a container or
``sglang_router`` leaves them). Each rank is a real process running bootstrap's
``init_parallel_runtime`` (``bootstrap_children``) with real gloo groups and real
/dev/shm; the kernel's ``initialize`` is ``bootstrap_standin_kernel``, which names,
creates and maps segments as the CPU build's shm.cpp does, from the environment at
the call. What a rank maps is read from its ``/proc/self/maps`` (device and inode).
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator

import pytest
from bootstrap_engines import SHM, _free_ports, _signal_and_wait, run_ranks, serving

UID = os.getuid()
HOST = "127.0.0.1"


def _names(*ports: int) -> list[str]:
    """What /dev/shm holds of the collective's segments for any of ``ports``."""
    marks = [f"_{port}_" for port in ports]
    return sorted(
        p.name
        for p in SHM.iterdir()
        if p.name.startswith("deepspeed_allreduce_buffer_")
        and any(m in p.name for m in marks)
    )


def _remove_left(ports: list[int]) -> None:
    for name in _names(*ports):
        if name.startswith(f"deepspeed_allreduce_buffer_{UID}_"):
            (SHM / name).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def all_ports() -> Iterator[list[int]]:
    """Ports for both tests' engines and inherited MASTER_PORTs, chosen at once (the
    pristine engines start while the other test runs); the collective's names of
    them left in /dev/shm (the pristine package never unlinks) go after."""
    used = _free_ports(6)
    yield used
    _remove_left(used)


@pytest.fixture(scope="module", autouse=True)
def pristine(all_ports) -> Iterator[Future]:
    """The pristine engines, started with the module: the two tests' engines set up
    side by side (each driver imports sglang on one core)."""
    tp2_port, pp2_port, inherited_port = all_ports[3:]
    # No sums: a rank of one engine may rewrite a file while another sums through it.
    specs = [{**spec, "sums": False} for spec in _engines(tp2_port, pp2_port)]
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool.submit(
            run_ranks, specs, pristine=True, environ=_inherited(inherited_port)
        )


def _engines(tp2_port: int, pp2_port: int) -> list[dict]:
    """Engine 0: TP 2; engine 1: TP 1 x PP 2. Each rank adds its own value."""
    shapes = [(0, tp2_port, 2, 1), (1, pp2_port, 1, 2)]
    return [
        {"engine": engine, "port": port, "tp_size": tp, "pp_size": pp,
         "tp_rank": tp_rank, "pp_rank": pp_rank,
         "value": 1 + tp_rank + pp_rank + 10 * engine}
        for engine, port, tp, pp in shapes
        for pp_rank in range(pp)
        for tp_rank in range(tp)
    ]  # fmt: skip


def _inherited(port: int) -> dict[str, str]:
    return {"MASTER_ADDR": HOST, "MASTER_PORT": str(port)}


def _segment(addr: str, port: int, rank: int) -> str:
    return f"/dev/shm/deepspeed_allreduce_buffer_{UID}_{addr}_{port}_{rank}"


def _inodes(report: dict) -> set[tuple[str, int]]:
    return {(m["dev"], m["inode"]) for m in report["shm_files"]}


def _stage(report: dict) -> tuple[int, int]:
    return report["engine"], report["pp_rank"]


def test_colocated_engines_and_stages_map_their_own_segments_and_leave_none(
    all_ports,
):
    ports = all_ports[:3]
    tp2_port, pp2_port, inherited_port = ports
    inherited = _inherited(inherited_port)
    with serving(_engines(tp2_port, pp2_port), environ=inherited) as reports:
        # Every rank is past init_parallel_runtime, and every name is gone.
        assert _names(*ports) == []
        by_stage: dict = {}
        for report in reports:
            by_stage.setdefault(_stage(report), []).append(report)
        for report in reports:
            engine, stage, rank = report["engine"], report["pp_rank"], report["tp_rank"]
            port, tp_size = (tp2_port, 2) if engine == 0 else (pp2_port, 1)
            addr = f"{HOST}@pp{stage}" if stage else HOST
            # The kernel named the segments by the engine's own address and stage.
            [init] = [c for c in report["calls"] if c["op"] == "initialize"]
            assert init["env"] == {
                "MASTER_ADDR": addr,
                "MASTER_PORT": str(port),
                "LOCAL_SIZE": str(tp_size),
            }
            assert report["segment"] == _segment(addr, port, rank)
            assert report["named_after_init"] is False  # unlinked by bootstrap
            # It maps its stage's segments, one per TP rank, every one unlinked.
            expected = sorted(_segment(addr, port, r) for r in range(tp_size))
            assert [m["path"] for m in report["shm_files"]] == expected
            assert all(m["deleted"] for m in report["shm_files"])
            # The ranks of a stage map the same files; no other rank maps any.
            peers = by_stage[_stage(report)]
            assert all(_inodes(p) == _inodes(report) for p in peers)
            others = [r for r in reports if _stage(r) != _stage(report)]
            assert all(not _inodes(o) & _inodes(report) for o in others)
            # MASTER_* are as inherited afterwards, in Python and in C; LOCAL_SIZE is
            # what upstream sets (parallel_state reads it).
            for layer in ("py", "c"):
                assert report["environ_after"][layer] == {
                    **inherited,
                    "LOCAL_SIZE": str(tp_size),
                }
                assert report["environ_before"][layer] == {
                    **inherited,
                    "LOCAL_SIZE": None,
                }
            assert report["group"]["local_size"] == tp_size
            assert report["shm_available"] is True
            # The TP sum went through those segments (TP 1 has nothing to sum).
            stage_sum = sum(p["value"] for p in peers)
            assert report["tp_sum"] == [stage_sum, 2 * stage_sum]
            shm_sums = [c for c in report["calls"] if c["op"] == "shm_allreduce"]
            assert len(shm_sums) == (1 if tp_size == 2 else 0)
            engine_sum = sum(
                s["value"]
                for s in _engines(tp2_port, pp2_port)
                if s["engine"] == engine
            )
            assert report["world_sum"] == engine_sum  # WORLD, over gloo
        # The TP 1 x PP 2 engine killed, the TP 2 one then stopped normally.
        _signal_and_wait([r for r in reports if r["engine"] == 1], signal.SIGKILL)
        assert _names(*ports) == []
    assert _names(*ports) == []


def test_before_the_change_inherited_master_env_names_one_set_of_segments_for_all(
    all_ports, pristine
):
    """The same two engines on pristine sglang 0.5.23: what the test above rules out."""
    ports = all_ports[3:]
    inherited_port = ports[2]
    reports = pristine.result()
    for report in reports:
        [init] = [c for c in report["calls"] if c["op"] == "initialize"]
        assert (init["env"]["MASTER_ADDR"], init["env"]["MASTER_PORT"]) == (
            HOST,
            str(inherited_port),
        )
        assert report["segment"] == _segment(HOST, inherited_port, report["tp_rank"])
        assert report["named_after_init"] is True
        assert not any(m["deleted"] for m in report["shm_files"])
    # TP rank 0 of the TP 2 engine and both stages of the other map one file.
    [shared] = set.intersection(*(_inodes(r) for r in reports if r["tp_rank"] == 0))
    assert len({_stage(r) for r in reports if shared in _inodes(r)}) == 3
    # And the names stay once the engines are gone.
    assert _names(*ports) == [
        os.path.basename(_segment(HOST, inherited_port, r)) for r in (0, 1)
    ]
