"""Running CPU engines' scheduler ranks through sglang's real bootstrap, from a test.

``run_ranks(specs)`` runs ``bootstrap_children.py ranks`` (one real process per rank,
real gloo groups, real /dev/shm) and returns every rank's report; ``serving(specs)``
keeps the ranks alive for the block, for a test to look at /dev/shm or kill them
(``_signal_and_wait``). ``_driver_env`` is the environment both give the ranks.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Mapping, Optional

HERE = Path(__file__).resolve().parent
HARNESS = HERE / "harness"
DRIVER = HERE / "bootstrap_children.py"
SHM = Path("/dev/shm")
PRISTINE_ROOT = Path(
    os.environ.get("SGLANG_PRISTINE_DIR") or HERE.parent / ".venv" / "pristine"
)
OVERLAID = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
CPUS = sorted(os.sched_getaffinity(0))


def _free_ports(count: int) -> list[int]:
    """``count`` ports free now, none of them next to another (an engine on port p
    also uses p + 1, bootstrap's dist port)."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port < 65535 and not {port, port + 1} & {
            p + d for p in ports for d in (-1, 0, 1)
        }:
            ports.append(port)
    return ports


def _driver_env(
    specs: list[dict], *, pristine: bool = False, environ: Optional[Mapping] = None
) -> dict:
    """The ranks' environment: this one without LOCAL_SIZE, plus ``environ``, one
    CPU group per gpu_id, NCCL pointed nowhere, and the sglang package asked for."""
    ranks = max(s["tp_size"] * s["pp_size"] for s in specs)
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_SIZE"}
    env.update(environ or {})
    env.update(
        # One CPU group per gpu_id (bootstrap's numa_index), as an operator sets it.
        SGLANG_CPU_OMP_THREADS_BIND="|".join(
            str(CPUS[i % len(CPUS)]) for i in range(ranks)
        ),
        # This torch is a CUDA build: without this sglang picks NCCL on CPU.
        SGLANG_NCCL_SO_PATH="/nonexistent/libnccl.so.2",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=os.pathsep.join(
            [*([str(PRISTINE_ROOT)] if pristine else []), str(HARNESS), str(HERE)]
        ),
        # The stand-in kernel waits for peers as shm.cpp does, for ever; this ends a
        # failing test's wait instead.
        SHM_STANDIN_DEADLINE_S="120",
    )
    return env


def _checked(reports: list[dict], specs: list[dict], pristine: bool) -> list[dict]:
    errors = [r["error"] for r in reports if "error" in r]
    assert not errors, "\n".join(errors)
    assert len(reports) == len(specs), reports
    package = (PRISTINE_ROOT / "sglang" if pristine else OVERLAID).resolve()
    for report in reports:
        if "package" in report:
            assert Path(report["package"]).resolve().is_relative_to(package)
    return sorted(reports, key=lambda r: (r["engine"], r["pp_rank"], r["tp_rank"]))


def run_ranks(
    specs: list[dict], *, pristine: bool = False, environ: Optional[Mapping] = None
) -> list[dict]:
    """Every rank's report, sorted by (engine, pp_rank, tp_rank); any rank's error
    fails. Every rank has exited when this returns."""
    out = subprocess.run(
        [sys.executable, str(DRIVER), "ranks"],
        input=json.dumps(specs) + "\n",
        capture_output=True,
        text=True,
        timeout=600,
        env=_driver_env(specs, pristine=pristine, environ=environ),
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return _checked(json.loads(out.stdout.strip().splitlines()[-1]), specs, pristine)


@contextlib.contextmanager
def serving(
    specs: list[dict], *, pristine: bool = False, environ: Optional[Mapping] = None
) -> Iterator[list[dict]]:
    """Ranks that stay alive after reporting, until the block ends (then those still
    alive exit normally): yields their reports, sorted as ``run_ranks``'s."""
    proc = subprocess.Popen(
        [sys.executable, str(DRIVER), "serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_driver_env(specs, pristine=pristine, environ=environ),
    )
    try:
        proc.stdin.write(json.dumps(specs) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-4000:]
        yield _checked(json.loads(line), specs, pristine)
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "gone"


def _signal_and_wait(reports: list[dict], sig: int) -> None:
    """Send ``sig`` to each rank and wait until it is dead (a zombie, or reaped)."""
    for report in reports:
        os.kill(report["pid"], sig)
    deadline = time.monotonic() + 60
    while any(_state(r["pid"]) not in ("Z", "gone") for r in reports):
        assert time.monotonic() < deadline, f"ranks survived signal {sig}"
        time.sleep(0.05)
