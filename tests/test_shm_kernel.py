"""sglang's real CPU kernel through sglang's bootstrap: the one built by
scripts/build_cpu_kernel.py and named by ``SGLANG_CPU_KERNEL`` (its ``common_ops*.so``
or the directory holding it), released (``--unpatched``) or with upstream_prs' kernel
patches (``initialize`` takes a group); skipped without it.

Every rank is a real process on real /dev/shm. This host has no AMX, so each rank
makes sglang's AMX gate true in its own process (bootstrap_children), or the shared
memory all-reduce would never be set up. Each test prints its figures (``-s``).
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
from bootstrap_engines import (
    DRIVER,
    SHM,
    _driver_env,
    _free_ports,
    _signal_and_wait,
    run_ranks,
    serving,
)

ALL_REDUCES = 200
# What the two-argument initialize writes per rank on the 2026-08 kernel: five int
# states, a double buffer of 1 MiB and four of 32 MiB (shm.cpp's allreduce_workspace).
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


@pytest.fixture(scope="module")
def groups(library) -> bool:
    """Whether this kernel has ``initialize.group`` (in a process of its own: the
    stand-in's tests define the same ops in this one)."""
    probe = "import sys, torch; torch.ops.load_library(sys.argv[1]); print(torch.ops.sgl_kernel.initialize.overloads())"  # fmt: skip
    done = subprocess.run([sys.executable, "-c", probe, library], check=True,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    return "'group'" in done.stdout


@pytest.fixture
def ports():
    """Ports of a test's engines; what /dev/shm holds of them is removed after."""
    used: list[int] = []
    yield used
    for port in used:
        for name in _left(port):
            (SHM / name).unlink(missing_ok=True)


def _left(port: int) -> list[str]:
    """/dev/shm's names of an engine on ``port``: either kernel's, and today's."""
    return sorted(p.name for p in SHM.iterdir() if f"_{port}_" in p.name)


def _specs(library: str, ports: list[int], **extra) -> list[dict]:
    values = {(e, r): 1 + r + 10 * e for e in range(len(ports)) for r in (0, 1)}
    return [
        {"engine": e, "tp_size": 2, "pp_size": 1, "tp_rank": r, "pp_rank": 0,
         "port": port, "schema": "kernel", "kernel": library, "value": values[e, r],
         "value_sum": values[e, 0] + values[e, 1], **extra}
        for e, port in enumerate(ports)
        for r in (0, 1)
    ]  # fmt: skip


def _driver(specs: list[dict], timeout_s: float = 300) -> list[dict]:
    """Every rank's report, errors included (the first error ends the wait)."""
    out = subprocess.run([sys.executable, str(DRIVER), "ranks"], input=json.dumps(specs),
                         capture_output=True, text=True, timeout=timeout_s,
                         env=_driver_env(specs))  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_two_colocated_engines_sum_through_their_own_segments(library, ports):
    """Two TP 2 engines through sglang's bootstrap, MASTER_* inherited by every rank."""
    *engines, inherited_port = _free_ports(3)
    ports.extend([*engines, inherited_port])
    inherited = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(inherited_port)}
    reports = run_ranks(
        _specs(library, engines, allreduces=ALL_REDUCES), environ=inherited
    )
    for report in reports:
        port = engines[report["engine"]]
        assert report["group"]["local_size"] == 2 and report["shm_available"] is True
        sums = report["all_reduces"]
        assert (sums["count"], sums["wrong"]) == (ALL_REDUCES, [])
        # Every sum went through the kernel's shared-memory all-reduce.
        assert sums["ops"] == {"sgl_kernel.shm_allreduce.default": ALL_REDUCES}
        # Two segments, its engine's, both without a name any more.
        maps = report["shm_maps"]
        assert len(maps) == 2 and all(m.endswith(" (deleted)") for m in maps)
        assert all(f"_{port}_" in m for m in maps if "/#" not in m)
        for layer in ("py", "c"):
            after = report["environ_after"][layer]
            assert {k: after[k] for k in inherited} == inherited
    assert [_left(p) for p in ports] == [[], [], []]
    print(f"figures: {len(reports)} ranks x {ALL_REDUCES} all-reduces, 0 wrong; maps "
          f"{[r['shm_maps'] for r in reports]}")  # fmt: skip


def test_an_engine_killed_after_set_up_leaves_nothing(library, ports):
    ports.extend(_free_ports(2))
    with serving(_specs(library, ports, allreduces=10)) as reports:
        assert [r["all_reduces"]["wrong"] for r in reports] == [[]] * 4
        assert [_left(p) for p in ports] == [[], []]  # running, and nothing named
        _signal_and_wait(reports[:2], signal.SIGKILL)
        _signal_and_wait(reports[2:], signal.SIGTERM)
        assert [_left(p) for p in ports] == [[], []]
    again = run_ranks(_specs(library, ports[:1], allreduces=10))
    assert [r["all_reduces"]["wrong"] for r in again] == [[], []]
    assert _left(ports[0]) == []


def test_an_engine_killed_in_set_up_restarts_on_its_address(library, ports):
    """Rank 0 killed while initialize waits for rank 1 (which has not called it yet),
    then the engine restarts on the same --dist-init-addr."""
    ports.extend(_free_ports(1))
    specs = _specs(library, ports, allreduces=50)
    plan = [
        {**specs[0], "at_initialize": "report"},
        {**specs[1], "at_initialize": "pause"},
    ]
    with serving(plan) as at_initialize:
        time.sleep(2)  # rank 0 is in initialize, its segment made
        waiting = _left(ports[0])
        _signal_and_wait(at_initialize, signal.SIGKILL)
    killed = _left(ports[0])
    started = time.monotonic()
    reports = _driver(specs)
    seconds = time.monotonic() - started
    errors = [r["error"].strip().splitlines()[-1] for r in reports if "error" in r]
    print(f"figures: while rank 0 waited {waiting}; after the kill {killed}; restart "
          f"{seconds:.1f} s, errors {errors}; left {_left(ports[0])}")  # fmt: skip
    assert errors == [] and [r["all_reduces"]["wrong"] for r in reports] == [[], []]
    assert _left(ports[0]) == []


def test_leftovers_of_the_released_kernel_at_the_address(library, groups, ports):
    """Files under the released kernel's names for this address (an older engine's)."""
    ports.extend(_free_ports(1))
    planted = [SHM / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{ports[0]}_{r}"
               for r in (0, 1)]  # fmt: skip
    for path in planted:
        with open(path, "x") as leftover:
            os.truncate(leftover.fileno(), WORKSPACE_BYTES)
    started = time.monotonic()
    reports = _driver(_specs(library, ports, allreduces=50))
    seconds = time.monotonic() - started
    errors = [r["error"].strip().splitlines()[-1] for r in reports if "error" in r]
    print(f"figures: start {seconds:.1f} s, errors {errors}; left {_left(ports[0])}")
    assert errors == [] and [r["all_reduces"]["wrong"] for r in reports] == [[], []]
    # A kernel with groups never touches them; the released one reused, then unlinked.
    assert _left(ports[0]) == ([p.name for p in planted] if groups else [])


def test_a_rank_that_never_joins_is_an_error_at_the_engines_dist_timeout(
    library, groups, ports
):
    if not groups:
        pytest.skip("the released kernel waits for a missing peer for ever")
    ports.extend(_free_ports(1))
    specs = [{**spec, "dist_timeout": 6} for spec in _specs(library, ports)]
    specs[1]["at_initialize"] = "pause"
    paused, failed = sorted(_driver(specs), key=lambda r: "error" in r)
    error = failed["error"].strip().splitlines()[-1]
    seconds = failed["at"] - paused["at_initialize"]  # both called initialize by then
    assert "waited 6 s for rank 1" in error
    # rank 0's segment stays named, shrunk to its header, for a rank still to come
    assert [(SHM / name).stat().st_size for name in _left(ports[0])] == [4096]
    print(f"figures: {error!r} {seconds:.1f} s after rank 1 stopped at initialize; "
          f"left {_left(ports[0])}")  # fmt: skip


@contextlib.contextmanager
def _kernel_ranks(specs: list[dict], **environ: str):
    """One ``bootstrap_children.py kernel`` process per spec, started together, with
    ``environ`` added; yields their reports, then lets them exit."""
    env = {**_driver_env(specs), **environ}
    procs = [
        subprocess.Popen([sys.executable, str(DRIVER), "kernel"], env=env, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        for _ in specs
    ]  # fmt: skip
    try:
        for proc, spec in zip(procs, specs):
            proc.stdin.write(json.dumps(spec) + "\n")
            proc.stdin.flush()
        yield [json.loads(proc.stdout.readline()) for proc in procs]
    finally:
        for proc in procs:
            proc.stdin.close()
            proc.wait(timeout=60)


def test_the_two_argument_initialize_works_as_before(library, ports):
    """``initialize(size, rank)`` names its segments from MASTER_ADDR/MASTER_PORT,
    reuses files and unlinks nothing, as the released kernel does."""
    ports.extend(_free_ports(1))
    specs = [{k: v for k, v in s.items() if k != "port"} | {"allreduces": 20}
             for s in _specs(library, ports)]  # fmt: skip
    environ = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(ports[0]),
               "LOCAL_SIZE": "2"}  # fmt: skip
    names = [f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{ports[0]}_{r}"
             for r in (0, 1)]  # fmt: skip
    with _kernel_ranks(specs, **environ) as reports:
        for report in reports:
            assert "error" not in report and report["all_reduces"]["wrong"] == []
            assert report["shm_maps"] == [f"{SHM}/{n}" for n in names]
    assert _left(ports[0]) == names
    assert {(SHM / n).stat().st_size for n in names} == {WORKSPACE_BYTES}
