"""sglang's real CPU kernel with kernel/0001-shm-namespace.patch, built by
scripts/build_cpu_kernel.py and named by ``SGLANG_CPU_KERNEL`` (its ``common_ops*.so``
or the directory holding it); skipped without it.

Every rank is a real process on real /dev/shm. This host has no AMX, so each rank
makes sglang's AMX gate true in its own process (bootstrap_children), or the shared
memory all-reduce would never be set up.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_bootstrap_engines import (
    DRIVER,
    SHM,
    _driver_env,
    _free_ports,
    _signal_and_wait,
    run_ranks,
    serving,
)

from sglang.srt.distributed.shm_namespace import ShmNamespace

ALL_REDUCES = 200
DEADLINE_S = 4.0
# sizeof(struct allreduce_workspace) in shm.cpp: five int states, a double buffer of
# 1 MiB and four of 32 MiB; what the two-argument initialize writes per rank.
WORKSPACE_BYTES = 5 * 4 + 2 * (1 << 20) + 8 * (32 << 20)


def _kernel_library() -> str:
    named = os.environ.get("SGLANG_CPU_KERNEL", "")
    if not named:
        pytest.skip(
            "set SGLANG_CPU_KERNEL to the CPU kernel scripts/build_cpu_kernel.py built "
            "(its common_ops*.so or the directory holding it) to run these"
        )
    path = Path(named)
    found = sorted(path.glob("common_ops*.so")) if path.is_dir() else [path]
    if len(found) != 1 or not found[0].is_file():
        pytest.fail(
            f"SGLANG_CPU_KERNEL={named!r}: expected a common_ops*.so file or a "
            f"directory holding exactly one; found {[str(f) for f in found]}"
        )
    return str(found[0].resolve())


@pytest.fixture(scope="module")
def library() -> str:
    return _kernel_library()


@pytest.fixture
def engines():
    """Namespaces of a test's engines; whatever is left of them is removed after."""
    used: list[ShmNamespace] = []
    yield used
    for namespace in used:
        for path in SHM.glob(f"{namespace.prefix}_*"):
            path.unlink(missing_ok=True)


def _left(*namespaces: ShmNamespace) -> list[str]:
    return sorted(p.name for ns in namespaces for p in SHM.glob(f"{ns.prefix}_*"))


def _specs(library: str, ports: list[int], **extra) -> list[dict]:
    values = {(e, r): 1 + r + 10 * e for e in range(len(ports)) for r in (0, 1)}
    return [
        {"engine": e, "tp_size": 2, "pp_size": 1, "tp_rank": r, "pp_rank": 0,
         "port": port, "schema": "kernel", "kernel": library, "value": values[e, r],
         "value_sum": values[e, 0] + values[e, 1], **extra}
        for e, port in enumerate(ports)
        for r in (0, 1)
    ]  # fmt: skip


def _maps_of(namespace: ShmNamespace) -> list[str]:
    return [f"{SHM}/{namespace.segment_name(r)} (deleted)" for r in (0, 1)]


def test_two_colocated_engines_sum_through_their_own_segments(library, engines):
    """Two TP 2 engines through sglang's bootstrap, MASTER_* inherited by every rank."""
    *ports, inherited_port = _free_ports(3)
    engines.extend(ShmNamespace(addr="127.0.0.1", port=p) for p in ports)
    inherited = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(inherited_port)}
    reports = run_ranks(
        _specs(library, ports, allreduces=ALL_REDUCES), environ=inherited
    )

    for report in reports:
        namespace = engines[report["engine"]]
        assert report["group"]["local_size"] == 2 and report["shm_available"] is True
        sums = report["all_reduces"]
        assert (sums["count"], sums["wrong"]) == (ALL_REDUCES, [])
        # Every sum went through the kernel's shared-memory all-reduce.
        assert sums["ops"] == {"sgl_kernel.shm_allreduce.default": ALL_REDUCES}
        # It maps its own engine's two segments, by the namespace's names, unlinked
        # by the kernel: sglang unlinked nothing.
        assert report["shm_maps"] == _maps_of(namespace)
        assert not [line for line in report["logs"] if "unlinked" in line]
        for layer in ("py", "c"):
            after = report["environ_after"][layer]
            assert {k: after[k] for k in inherited} == inherited
    assert _left(*engines) == []
    print(f"figures: {len(reports)} ranks x {ALL_REDUCES} all-reduces, 0 wrong; maps "
          f"{[r['shm_maps'] for r in reports]}; left {_left(*engines)}")  # fmt: skip


def test_an_engine_killed_after_set_up_leaves_nothing(library, engines):
    [port] = _free_ports(1)
    engines.append(ShmNamespace(addr="127.0.0.1", port=port))
    with serving(_specs(library, [port], allreduces=10)) as reports:
        assert [r["all_reduces"]["wrong"] for r in reports] == [[], []]
        assert _left(*engines) == []  # running, set up, and nothing named
        _signal_and_wait(reports, signal.SIGKILL)
        assert _left(*engines) == []
        print(f"figures: killed {[r['pid'] for r in reports]}; left {_left(*engines)}")
    # The next engine on that address starts as the first did.
    again = run_ranks(_specs(library, [port], allreduces=10))
    assert [r["all_reduces"]["wrong"] for r in again] == [[], []]
    assert _left(*engines) == []


@contextlib.contextmanager
def _kernel_ranks(specs: list[dict], timeout_s: float = 120, **environ: str):
    """One ``bootstrap_children.py kernel`` process per spec, started together, with
    ``environ`` added; yields their reports, then lets them exit."""
    env = {**_driver_env(specs), "SGLANG_CPU_SHM_INIT_TIMEOUT": str(DEADLINE_S)}
    env.update(environ)
    procs = [
        subprocess.Popen([sys.executable, str(DRIVER), "kernel"], env=env, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        for _ in specs
    ]  # fmt: skip
    try:
        for proc, spec in zip(procs, specs):
            proc.stdin.write(json.dumps(spec) + "\n")
            proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        lines = [proc.stdout.readline() for proc in procs]
        assert time.monotonic() < deadline and all(lines), lines
        yield [json.loads(line) for line in lines]
    finally:
        for proc in procs:
            proc.stdin.close()
            proc.wait(timeout=60)


def test_a_file_planted_under_a_name_is_refused(library, engines):
    [port] = _free_ports(1)
    namespace = ShmNamespace(addr="127.0.0.1", port=port)
    engines.append(namespace)
    planted = SHM / namespace.segment_name(1)
    planted.touch(mode=0o600, exist_ok=False)
    before = planted.stat()
    specs = [{**spec, "allreduces": 5} for spec in _specs(library, [port])]
    with _kernel_ranks(specs) as (rank0, rank1):
        assert rank1["error"].startswith(
            f"sgl_kernel::initialize: {planted} already exists"
        )
        assert rank1["wall_s"] < 2
        # Its peer never mapped the empty file; it gave up at the deadline.
        assert "waited 4 s for rank 1" in rank0["error"]
        assert "the file exists but is still empty" in rank0["error"]
        assert rank0["shm_maps"] == rank1["shm_maps"] == []
    assert _left(namespace) == [planted.name]
    print(f"figures: rank 1 refused in {rank1['wall_s']:.3f} s, rank 0 in "
          f"{rank0['wall_s']:.2f} s; left {_left(namespace)}")  # fmt: skip
    assert (planted.stat().st_ino, planted.stat().st_size) == (before.st_ino, 0)


def test_a_peer_that_never_starts_is_an_error_at_the_deadline(library, engines):
    [port] = _free_ports(1)
    namespace = ShmNamespace(addr="127.0.0.1", port=port)
    engines.append(namespace)
    [spec, _never] = _specs(library, [port])
    with _kernel_ranks([spec]) as [report]:
        assert report["error"] == (
            f"sgl_kernel::initialize: rank 0 waited 4 s for rank 1 of namespace "
            f"'{namespace.prefix}' to set up {SHM}/{namespace.segment_name(1)}: that "
            f"rank did not start, failed before it, or uses another namespace "
            f"(SGLANG_CPU_SHM_INIT_TIMEOUT sets the wait)"
        )
        assert DEADLINE_S <= report["wall_s"] < DEADLINE_S + 2
        # It paused between tries: a spin would burn the whole wait on a CPU.
        assert report["cpu_s"] < 0.25 * DEADLINE_S
    assert _left(namespace) == []  # its own segment is gone too
    print(f"figures: error after {report['wall_s']:.2f} s wall, {report['cpu_s']:.3f} s "
          f"CPU; left {_left(namespace)}")  # fmt: skip


def test_the_two_argument_initialize_works_as_before(library, engines):
    """``initialize(size, rank)`` names its segments from MASTER_ADDR/MASTER_PORT,
    reuses nothing exclusively and unlinks nothing, as the released kernel does."""
    [port] = _free_ports(1)
    legacy = ShmNamespace(addr="127.0.0.1", port=port)
    engines.append(legacy)
    specs = [
        {k: v for k, v in spec.items() if k != "port"} | {"allreduces": 20}
        for spec in _specs(library, [port])
    ]
    environ = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "LOCAL_SIZE": "2"}
    with _kernel_ranks(specs, **environ) as reports:
        for report in reports:
            assert "error" not in report and report["all_reduces"]["wrong"] == []
            assert report["shm_maps"] == [
                f"{SHM}/{legacy.segment_name(r)}" for r in (0, 1)
            ]
    names = _left(legacy)
    assert names == [legacy.segment_name(0), legacy.segment_name(1)]
    assert {(SHM / n).stat().st_size for n in names} == {WORKSPACE_BYTES}
    print(f"figures: left {names}, {WORKSPACE_BYTES} bytes each")
