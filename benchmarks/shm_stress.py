"""What a CPU engine killed at a random point of set-up, or after it, leaves in /dev/shm.

    .venv/bin/python benchmarks/shm_stress.py [--trials 10] [--seed 1]

Each trial starts a TP 2 CPU engine through bootstrap's real path (the ranks of
``tests/bootstrap_children.py``, on ``tests/bootstrap_standin_kernel.py``), SIGKILLs
the whole engine (every rank) at a random point: right after, or up to 0.5 s after,
a step drawn at random (a rank's start, ``initialize`` done, the unlink, the sums
done), and counts the engine's names left in ``/dev/shm``. The step reached is the
least advanced rank's, from the lines the ranks print right after each step
(``BOOTSTRAP_CHILDREN_STEPS=1``): ``start`` (before or in ``initialize``),
``initialised`` (past ``initialize``, the groups not built yet), ``unlinked``,
``served``. When names are left, the next engine on that address runs to the end,
and the names left after it are counted too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
DRIVER = TESTS / "bootstrap_children.py"
SHM = Path("/dev/shm")
STEPS = ("not started", "start", "initialised", "unlinked", "served")
_MARKS = {f": {step}": step for step in STEPS[1:]}


def _free_port() -> int:
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port < 65535:  # the engine also uses port + 1
            return port


def _specs(port: int) -> list[dict]:
    return [
        {"engine": 0, "tp_size": 2, "pp_size": 1, "tp_rank": r, "pp_rank": 0,
         "port": port, "value": 1 + r}
        for r in range(2)
    ]  # fmt: skip


def _env() -> dict:
    cpus = sorted(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_SIZE"}
    env.update(
        SGLANG_CPU_OMP_THREADS_BIND="|".join(str(cpus[i % len(cpus)]) for i in (0, 1)),
        SGLANG_NCCL_SO_PATH="/nonexistent/libnccl.so.2",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=os.pathsep.join([str(TESTS / "harness"), str(TESTS)]),
        SHM_STANDIN_DEADLINE_S="300",
        BOOTSTRAP_CHILDREN_STEPS="1",
    )
    return env


def _names(port: int) -> list[str]:
    marker = f"_127.0.0.1_{port}_"
    return sorted(p.name for p in SHM.iterdir() if marker in p.name)


class Engine:
    """A TP 2 engine in its own process group, its ranks' steps read as they print."""

    def __init__(self, port: int) -> None:
        self.steps = {0: "not started", 1: "not started"}
        self.pids: set[int] = set()
        self.reached = {step: threading.Event() for step in STEPS}
        self.served = threading.Event()
        self.proc = subprocess.Popen(
            [sys.executable, str(DRIVER), "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
            start_new_session=True,
        )
        self.proc.stdin.write(json.dumps(_specs(port)) + "\n")
        self.proc.stdin.flush()
        self._reader = threading.Thread(target=self._read_steps, daemon=True)
        self._reader.start()
        threading.Thread(target=self._read_reports, daemon=True).start()

    def _read_steps(self) -> None:
        for line in self.proc.stderr:
            words = line.split()
            if words[:1] != ["step"] or words[2:3] != ["rank"]:
                continue
            self.pids.add(int(words[1]))
            rank = int(words[3].rstrip(":"))
            for mark, step in _MARKS.items():
                if mark in line and STEPS.index(step) > STEPS.index(self.steps[rank]):
                    self.steps[rank] = step
                    self.reached[step].set()

    def _read_reports(self) -> None:
        if self.proc.stdout.readline():
            self.served.set()

    def step(self) -> str:
        return min(self.steps.values(), key=STEPS.index)

    def kill(self) -> None:
        """SIGKILL every rank that has started, as an operator kills an engine's
        schedulers; the driver then ends the rest and reaps them."""
        for pid in list(self.pids):
            os.kill(pid, signal.SIGKILL)
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self._reader.join(timeout=60)

    def finish(self, timeout_s: float = 600) -> None:
        if not self.served.wait(timeout_s):
            self.kill()
            raise RuntimeError("the engine did not finish its set-up")
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)

    left_by_step: dict[str, Counter] = {}
    after_next = Counter()
    for trial in range(args.trials):
        port = _free_port()
        target = rng.choice(STEPS[1:])
        delay = rng.uniform(0, 0.5)
        engine = Engine(port)
        if not engine.reached[target].wait(600):
            raise RuntimeError(f"no rank reached {target!r}")
        time.sleep(delay)
        engine.kill()
        step = engine.step()  # every line printed before the kill read
        left = _names(port)
        left_by_step.setdefault(step, Counter())[len(left)] += 1
        line = (
            f"trial {trial}: killed {delay:.2f} s after a rank's {target!r}, least "
            f"advanced rank at {step!r}: {len(left)} left"
        )
        if left:
            Engine(port).finish()
            after_next[len(_names(port))] += 1
            line += f"; after the next engine: {len(_names(port))}"
        print(line, flush=True)
        for name in _names(port):
            (SHM / name).unlink()

    print("names left per kill, by the step the least advanced rank had reached:")
    for step in STEPS:
        if step in left_by_step:
            counts = ", ".join(
                f"{n} left x{c}" for n, c in sorted(left_by_step[step].items())
            )
            print(f"  {step:12} {counts}")
    shown = ", ".join(f"{n} left x{c}" for n, c in sorted(after_next.items())) or "-"
    print(f"after the next engine on the same address: {shown}")


if __name__ == "__main__":
    main()
