"""Bootstrap's real CPU path in real scheduler ranks: real spawned processes, real gloo
groups built by sglang's own ``GroupCoordinator``, real /dev/shm.

Each rank runs upstream's ``init_parallel_runtime`` (see ``bootstrap_children``);
only the CPU kernel's ops, the AMX flag and NCCL's absence are stood in. The TP
all-reduce is ``GroupCoordinator.all_reduce``: it goes through the (stand-in)
shared-memory kernel only when ``is_shm_available(dtype, world_size, local_size)``
says yes, so its sum and the kernel's call log show which path every rank took.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import HARNESS

from sglang.srt.distributed.shm_namespace import ShmNamespace

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "bootstrap_children.py"
PRISTINE_ROOT = Path(
    os.environ.get("SGLANG_PRISTINE_DIR") or HERE.parent / ".venv" / "pristine"
)
OVERLAID = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
SHM = Path("/dev/shm")
CPUS = sorted(os.sched_getaffinity(0))


def _free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        # The engine also uses port + 1 (bootstrap's dist_port).
        if not {port, port + 1} & {p + d for p in ports for d in (0, 1)}:
            ports.append(port)
    return ports


def _names(*namespaces: ShmNamespace) -> list[str]:
    """What /dev/shm holds of these namespaces, for either kernel."""
    prefixes = tuple(
        f"{p}_" for ns in namespaces for p in (ns.prefix, ns.group_namespace)
    )
    return sorted(p.name for p in SHM.iterdir() if p.name.startswith(prefixes))


@pytest.fixture
def namespaces():
    """Namespaces a test's engines use; what is left of them is removed afterwards
    (the pristine package never unlinks its segments)."""
    used: list[ShmNamespace] = []
    yield used
    for ns in used:
        for path in SHM.glob(f"{ns.prefix}_*"):
            path.unlink(missing_ok=True)


def _specs(*, engine: int, port: int, tp_size: int, pp_size: int, schema: str):
    return [
        {
            "engine": engine,
            "tp_size": tp_size,
            "pp_size": pp_size,
            "tp_rank": tp_rank,
            "pp_rank": pp_rank,
            "port": port,
            "schema": schema,
            "value": 1 + pp_rank * tp_size + tp_rank + 10 * engine,
        }
        for pp_rank in range(pp_size)
        for tp_rank in range(tp_size)
    ]


def _driver_env(specs, *, pristine: bool = False, environ=None) -> dict:
    ranks_per_engine = max(s["tp_size"] * s["pp_size"] for s in specs)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_SIZE",)}
    env.update(environ or {})
    env.update(
        # One CPU group per gpu_id (bootstrap's numa_index), as an operator sets it.
        SGLANG_CPU_OMP_THREADS_BIND="|".join(
            str(CPUS[i % len(CPUS)]) for i in range(ranks_per_engine)
        ),
        # A CPU build of torch has no NCCL; this CUDA build brings one along.
        SGLANG_NCCL_SO_PATH="/nonexistent/libnccl.so.2",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=os.pathsep.join(
            [HARNESS, *([str(PRISTINE_ROOT)] if pristine else [])]
        ),
        # The stand-in kernel's peer loop never gives up, as shm.cpp's: a deadline
        # only keeps a failing test from hanging.
        SHM_STANDIN_PEER_DEADLINE_S="120",
    )
    return env


def run_ranks(specs, *, pristine: bool = False, environ=None) -> list[dict]:
    """Every rank's report, sorted by (engine, pp_rank, tp_rank); any rank's error fails."""
    out = subprocess.run(
        [sys.executable, str(DRIVER), "ranks"],
        input=json.dumps(specs),
        capture_output=True,
        text=True,
        timeout=600,
        env=_driver_env(specs, pristine=pristine, environ=environ),
    )
    assert out.returncode == 0, out.stderr[-4000:]
    reports = json.loads(out.stdout.strip().splitlines()[-1])
    errors = [r["error"] for r in reports if "error" in r]
    assert not errors, "\n".join(errors)
    assert len(reports) == len(specs)
    package = (PRISTINE_ROOT / "sglang" if pristine else OVERLAID).resolve()
    assert all(Path(r["package"]).resolve().is_relative_to(package) for r in reports)
    return sorted(reports, key=lambda r: (r["engine"], r["pp_rank"], r["tp_rank"]))


def _ops(report: dict) -> list[str]:
    return [c["op"] for c in report["calls"]]


def _environ(report: dict, when: str, layer: str = "py") -> dict:
    if when == "before":
        return report["environ_before"]
    return report["environ_after"][layer]


# ------------------------------------------------------- LOCAL_SIZE and the shm all-reduce


# sglang's one reader of MASTER_ADDR, parallel_state's global TCPStore (NIXL's), falls
# back to rank 0's address, which this names: another loopback address than the engines'.
HOST_IP = {"SGLANG_HOST_IP": "127.0.0.2"}


def _tcp_store(report: dict) -> list[str]:
    """The host of the rank's global TCPStore, and any warning on the way."""
    return [re.sub(r":\d+ \(rank=.*", "", line) for line in report["tcp_store"]]


def _tp2_engine(port: int, *, pristine: bool = False) -> list[dict]:
    """One tp=2 engine on the released kernel, its global TCPStore made as well."""
    store = next(p for p in _free_ports(3) if p not in (port, port + 1))
    specs = _specs(engine=0, port=port, tp_size=2, pp_size=1, schema="released")
    specs = [{**spec, "tcp_store_port": store} for spec in specs]
    return run_ranks(specs, pristine=pristine, environ=HOST_IP)


@pytest.fixture(scope="module")
def tp2_overlaid():
    [port] = _free_ports(1)
    ns = ShmNamespace(addr="127.0.0.1", port=port)
    try:
        yield port, _tp2_engine(port)
    finally:
        for path in SHM.glob(f"{ns.prefix}_*"):
            path.unlink(missing_ok=True)


def test_cpu_tp_group_uses_the_shared_memory_all_reduce(tp2_overlaid):
    port, reports = tp2_overlaid
    for report in reports:
        # parallel_state's GroupCoordinator read LOCAL_SIZE: every rank is local.
        assert report["group"] == {"world_size": 2, "local_size": 2, "ranks": [0, 1]}
        assert report["shm_available"] is True
        assert _environ(report, "after")["LOCAL_SIZE"] == "2"
        assert _environ(report, "after", "c")["LOCAL_SIZE"] == "2"
        # So GroupCoordinator.all_reduce went through the kernel, and summed right.
        assert _ops(report) == ["init_cpu_threads_env", "initialize", "shm_allreduce"]
        assert report["tp_sum"] == [3.0, 6.0]
        assert report["world_sum"] == 3.0  # WORLD, over gloo
        # The kernel saw the engine's own address; the process environment did not.
        [initialize] = [c for c in report["calls"] if c["op"] == "initialize"]
        assert initialize["env"] == {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "LOCAL_SIZE": "2",
        }
        for layer in ("py", "c"):
            after = _environ(report, "after", layer)
            assert (after["MASTER_ADDR"], after["MASTER_PORT"]) == (None, None)
        segment = ShmNamespace(addr="127.0.0.1", port=port).segment_name(
            report["tp_rank"]
        )
        assert report["segment"] == segment and report["segment_mode"] is None
        # Unlinked once sglang built the groups; the all-reduce above still summed.
        assert report["segment_exists"] is False
        assert any(f"unlinked ['/dev/shm/{segment}']" in x for x in report["logs"])
        # The rank's threads run on its SGLANG_CPU_OMP_THREADS_BIND group.
        cpu = CPUS[report["tp_rank"] % len(CPUS)]
        assert report["calls"][0] == {"op": "init_cpu_threads_env", "cpu_ids": str(cpu)}
        assert report["affinity"] == [cpu]


def test_what_parallel_state_reads_is_what_pristine_sglang_gives_it(
    tp2_overlaid, namespaces
):
    overlaid_port, overlaid = tp2_overlaid
    [port] = _free_ports(1)
    namespaces.append(ShmNamespace(addr="127.0.0.1", port=port))
    pristine = _tp2_engine(port, pristine=True)

    def read_by_sglang(report: dict) -> dict:
        return {
            "LOCAL_SIZE": (
                _environ(report, "after")["LOCAL_SIZE"],
                _environ(report, "after", "c")["LOCAL_SIZE"],
            ),
            "group": report["group"],
            "shm_available": report["shm_available"],
            "ops": _ops(report),
            "tp_sum": report["tp_sum"],
            "world_sum": report["world_sum"],
            "environ_changed": report["environ_changed"],
            "kernel_local_size": report["calls"][1]["env"]["LOCAL_SIZE"],
        }

    assert [read_by_sglang(r) for r in overlaid] == [
        read_by_sglang(r) for r in pristine
    ]
    for theirs, ours in zip(pristine, overlaid):
        rank = theirs["tp_rank"]
        # The kernel names the segments alike: engine address, port, rank.
        assert theirs["segment"] == namespaces[0].segment_name(rank)
        assert ours["segment"] == ShmNamespace(
            addr="127.0.0.1", port=overlaid_port
        ).segment_name(rank)
        # The one difference: upstream leaves MASTER_ADDR/MASTER_PORT set (setdefault).
        assert _environ(theirs, "after")["MASTER_PORT"] == str(port)
        assert _environ(ours, "after")["MASTER_PORT"] is None
        # So NIXL's global TCPStore, which reads MASTER_ADDR, finds the engine's host
        # there upstream; here it warns and takes rank 0's address, as on a GPU engine.
        assert _tcp_store(theirs) == ["INFO Created global TCPStore at 127.0.0.1"]
        assert _tcp_store(ours) == [
            "WARNING Could not determine master IP for global TCPStore. "
            "Broadcasting from rank 0 to all ranks.",
            "INFO Created global TCPStore at 127.0.0.2",
        ]


# ------------------------------------------------------------- co-located engines, stages


@pytest.mark.parametrize("schema", ["released", "group"])
def test_two_engines_tp2_never_share_segments(schema, namespaces):
    engine_ports = _free_ports(5)
    inherited_port = engine_ports.pop()
    store_ports = [engine_ports.pop(), engine_ports.pop()]
    namespaces.extend(ShmNamespace(addr="127.0.0.1", port=p) for p in engine_ports)
    # What a launcher (or a user's shell) leaves behind: every rank inherits it.
    inherited = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(inherited_port)}
    specs = [
        spec
        for engine, port in enumerate(engine_ports)
        for spec in _specs(
            engine=engine, port=port, tp_size=2, pp_size=1, schema=schema
        )
    ]
    for spec in specs:
        spec["tcp_store_port"] = store_ports[spec["engine"]]
    reports = run_ranks(specs, environ={**inherited, **HOST_IP})

    assert len({r["segment"] for r in reports}) == 4
    for report in reports:
        engine, rank = report["engine"], report["tp_rank"]
        namespace = namespaces[engine]
        [initialize] = [c for c in report["calls"] if c["op"] == "initialize"]
        assert initialize["schema"] == schema
        prefix = namespace.prefix
        if schema == "group":  # the launch's nonce, from TP rank 0 to every rank
            [group] = {c["group"] for r in reports if r["engine"] == engine
                       for c in r["calls"] if c["op"] == "initialize"}  # fmt: skip
            assert re.fullmatch("[0-9a-f]{16}", group)
            prefix = f"{namespace.group_namespace}_{group}"
            assert initialize["timeout"] == 1800.0  # torch's default, no --dist-timeout
        assert report["segment"] == initialize["segment"] == f"{prefix}_{rank}"
        # Its peers are its own engine's ranks, and nobody else's.
        assert report["peer_prefixes"] == {"0": prefix, "1": prefix}
        assert report["segment_mode"] is None  # unlinked
        expected = (1 + 10 * engine) + (2 + 10 * engine)
        assert report["tp_sum"] == [expected, 2 * expected]  # through shared memory
        assert report["world_sum"] == expected  # over gloo
        assert "shm_allreduce" in _ops(report)
        # The environment each rank started with is what it ends with, LOCAL_SIZE aside.
        for layer in ("py", "c"):
            after = _environ(report, "after", layer)
            assert {k: after[k] for k in inherited} == inherited
            assert after["LOCAL_SIZE"] == "2"
        assert report["segment_exists"] is False
        # NIXL's global TCPStore reads the inherited MASTER_ADDR, as upstream's does.
        assert _tcp_store(report) == ["INFO Created global TCPStore at 127.0.0.1"]
        if schema == "released":
            assert initialize["env"] == {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(engine_ports[engine]),
                "LOCAL_SIZE": "2",
            }
        else:
            assert initialize["env"] == {**inherited, "LOCAL_SIZE": "2"}


def test_every_pipeline_stage_of_a_cpu_engine_gets_its_own_segments(namespaces):
    """PP 2 x TP 2: the stages' TP ranks share an address, yet no segment or record."""
    [port] = _free_ports(1)
    base = ShmNamespace(addr="127.0.0.1", port=port)
    namespaces.extend([base, dataclasses.replace(base, pp_rank=1)])
    reports = run_ranks(
        _specs(engine=0, port=port, tp_size=2, pp_size=2, schema="released")
    )

    assert len({r["segment"] for r in reports}) == 4
    assert len({r["pid"] for r in reports}) == 4
    for report in reports:
        stage = dataclasses.replace(base, pp_rank=report["pp_rank"])
        assert report["segment"] == stage.segment_name(report["tp_rank"])
        assert report["peer_prefixes"] == {"0": stage.prefix, "1": stage.prefix}
        assert report["segment_exists"] is False
        assert report["group"]["local_size"] == 2 and report["shm_available"] is True
        first = 1 + 2 * report["pp_rank"]
        assert report["tp_sum"] == [
            2 * first + 1,
            2 * (2 * first + 1),
        ]  # the stage's two
        assert report["world_sum"] == 1 + 2 + 3 + 4
    assert [r["segment"].split("_")[-3] for r in reports] == [
        "127.0.0.1",
        "127.0.0.1",
        "127.0.0.1@pp1",
        "127.0.0.1@pp1",
    ]


# ------------------------------------------------------------------ nothing left behind


@contextlib.contextmanager
def serving(specs):
    """Engines whose ranks stay alive after reporting, until the block ends: yields
    their reports (or, for ``pause_before_groups`` specs, where they wait)."""
    proc = subprocess.Popen(
        [sys.executable, str(DRIVER), "serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_driver_env(specs),
    )
    try:
        proc.stdin.write(json.dumps(specs) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-4000:]
        reports = json.loads(line)
        errors = [r["error"] for r in reports if "error" in r]
        assert not errors, "\n".join(errors)
        yield sorted(reports, key=lambda r: (r["engine"], r["pp_rank"], r["tp_rank"]))
    finally:
        proc.stdin.close()
        proc.wait(timeout=120)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "gone"


def _signal_and_wait(reports, sig) -> None:
    """Send ``sig`` to each rank and wait until it is dead (a zombie, or reaped)."""
    for report in reports:
        os.kill(report["pid"], sig)
    deadline = time.monotonic() + 60
    while any(_state(r["pid"]) not in ("Z", "gone") for r in reports):
        assert time.monotonic() < deadline, f"ranks survived signal {sig}"
        time.sleep(0.05)


def test_killed_and_stopped_engines_leave_nothing_in_dev_shm(namespaces):
    """Two co-located TP 2 engines, through bootstrap's real path: one SIGKILLed, the
    other SIGTERMed after their all-reduces; a third then starts on the first's
    address."""
    ports = _free_ports(2)
    engines = [ShmNamespace(addr="127.0.0.1", port=p) for p in ports]
    namespaces.extend(engines)
    specs = [
        spec
        for engine, port in enumerate(ports)
        for spec in _specs(
            engine=engine, port=port, tp_size=2, pp_size=1, schema="released"
        )
    ]
    with serving(specs) as reports:
        for report in reports:
            expected = 3 + 20 * report["engine"]
            assert report["tp_sum"] == [expected, 2 * expected]
            assert "shm_allreduce" in _ops(report)
        # Both engines run, and every name is gone already.
        assert _names(*engines) == []
        _signal_and_wait(reports[:2], signal.SIGKILL)
        _signal_and_wait(reports[2:], signal.SIGTERM)
        assert _names(*engines) == []

    third = run_ranks(
        _specs(engine=0, port=ports[0], tp_size=2, pp_size=1, schema="released")
    )
    assert [r["tp_sum"] for r in third] == [[3.0, 6.0], [3.0, 6.0]]
    assert _names(*engines) == []


def test_ranks_killed_in_set_up_leave_their_segments_and_the_next_engine_removes_them(
    namespaces,
):
    [port] = _free_ports(1)
    engine = ShmNamespace(addr="127.0.0.1", port=port)
    namespaces.append(engine)
    specs = _specs(engine=0, port=port, tp_size=2, pp_size=1, schema="released")
    with serving([{**s, "pause_before_groups": True} for s in specs]) as paused:
        assert all(r["paused"] for r in paused)
        # Past initialize, before the groups and the unlink: each rank's own segment.
        assert _names(engine) == [engine.segment_name(0), engine.segment_name(1)]
        _signal_and_wait(paused, signal.SIGKILL)
    # Each killed rank left its own segment and nothing else.
    assert _names(engine) == [engine.segment_name(0), engine.segment_name(1)]

    reports = run_ranks(specs)
    assert [r["tp_sum"] for r in reports] == [[3.0, 6.0], [3.0, 6.0]]
    for report in reports:
        # The kernel reused the file left under its name (O_CREAT, no O_EXCL), and
        # its peer mapped that same file: the sum above went through it.
        assert report["peer_prefixes"] == {"0": engine.prefix, "1": engine.prefix}
        assert report["segment_exists"] is False
    assert _names(engine) == []
