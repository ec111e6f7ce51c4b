"""Load test of the shared-memory owner records: processes claim and release segments at random while owners are SIGKILLed; no live segment may be touched.

    .venv/bin/python benchmarks/shm_stress.py [--processes 8] [--seconds 40] [--namespaces 3] [--ranks 4]

Each worker process claims (``claim_segment``, which sweeps dead owners' segments)
and releases segments of a few namespaces at random, writes its own content into
each segment it claims as the CPU kernel would, and after every step checks that
every segment it still owns exists with that content. A killer SIGKILLs a random
owner now and then and starts a fresh worker in its place. At the end a sweep
must leave nothing behind. Runs in a private directory under /dev/shm (or
``--shm-dir``), which it removes.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from typing import Optional

from sglang.srt.distributed.shm_errors import ShmCollectiveError
from sglang.srt.distributed.shm_namespace import ShmNamespace
from sglang.srt.distributed.shm_segments import (
    claim_segment,
    release_shm_collective,
    remove_stale_segments,
)

_BASE_PORT = 41000
# Per-worker counters in one shared array, written only by the slot's own worker
# (no lock, so a SIGKILL can never leave one held).
_CLAIMS, _RELEASES, _CONFLICTS, _TOUCHED, _HELD = range(5)
_FIELDS = 5
_MAX_HELD = 3


@dataclasses.dataclass(frozen=True)
class StressResult:
    processes: int
    seconds: float
    claims: int
    releases: int
    conflicts: int
    owners_killed: int
    live_touched: int
    leftovers: tuple[str, ...]


def _namespaces(count: int) -> list[ShmNamespace]:
    return [ShmNamespace(addr="127.0.0.1", port=_BASE_PORT + i) for i in range(count)]


def _read(path: str) -> Optional[bytes]:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _worker(
    slot: int,
    counters,
    shm_dir: str,
    namespaces: int,
    ranks: int,
    seed: int,
    deadline: float,
) -> None:
    rng = random.Random(seed * 1_000_003 + os.getpid())
    spaces = _namespaces(namespaces)
    base = slot * _FIELDS
    held: dict[tuple[int, int], bytes] = {}
    steps = 0

    def path(key: tuple[int, int]) -> str:
        return os.path.join(shm_dir, spaces[key[0]].segment_name(key[1]))

    while time.time() < deadline:
        steps += 1
        if held and (len(held) >= _MAX_HELD or rng.random() < 0.5):
            key = rng.choice(list(held))
            del held[key]
            release_shm_collective(spaces[key[0]], rank=key[1])
            counters[base + _RELEASES] += 1
        else:
            key = (rng.randrange(namespaces), rng.randrange(ranks))
            if key in held:
                continue
            try:
                claim_segment(spaces[key[0]], rank=key[1], shm_dir=shm_dir, wait_s=0)
            except ShmCollectiveError:
                counters[base + _CONFLICTS] += 1
                continue
            content = f"pid {os.getpid()} step {steps}\n".encode()
            # As the kernel does: O_CREAT without O_EXCL, so a segment that someone
            # failed to remove would be reused, not refused.
            fd = os.open(path(key), os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
            os.write(fd, content)
            os.close(fd)
            held[key] = content
            counters[base + _CLAIMS] += 1
        counters[base + _HELD] = len(held)
        time.sleep(rng.uniform(0, 0.004))
        for key, content in list(held.items()):
            if _read(path(key)) != content:
                counters[base + _TOUCHED] += 1
                # Not ours any more: stop watching it rather than count it again.
                del held[key]
    release_shm_collective()
    counters[base + _HELD] = 0


def _noop() -> None:
    pass


def _leftovers(shm_dir: str) -> tuple[str, ...]:
    found = []
    for root, dirs, files in os.walk(shm_dir):
        found += [os.path.relpath(os.path.join(root, n), shm_dir) for n in dirs + files]
    return tuple(sorted(found))


def run(
    *,
    processes: int,
    seconds: float,
    shm_dir: str,
    namespaces: int = 3,
    ranks: int = 4,
    kill_interval: float = 0.7,
    seed: int = 0,
) -> StressResult:
    """Run the load in ``shm_dir`` (which should start empty) and report what happened."""
    # Workers fork from a server that imported the shm modules once: a restarted owner is back at
    # once, instead of paying sglang.srt.distributed's imports (seconds) inside the measured window.
    context = multiprocessing.get_context("forkserver")
    # By package name: the fork server does not get this process's sys.path, so a
    # module found through it (this one, when imported by a test) would not preload.
    context.set_forkserver_preload(["sglang.srt.distributed.shm_segments"])
    warm_up = context.Process(target=_noop)
    warm_up.start()
    warm_up.join()
    counters = context.RawArray("q", processes * _FIELDS)
    deadline = time.time() + seconds
    rng = random.Random(seed)

    def start(slot: int):
        worker = context.Process(
            target=_worker,
            args=(
                slot,
                counters,
                shm_dir,
                namespaces,
                ranks,
                rng.randrange(2**31),
                deadline,
            ),
        )
        worker.start()
        return worker

    workers = [start(slot) for slot in range(processes)]
    killed = 0
    try:
        while time.time() < deadline:
            time.sleep(rng.uniform(0.5, 1.5) * kill_interval)
            owners = [
                s
                for s in range(processes)
                if workers[s].is_alive() and counters[s * _FIELDS + _HELD] > 0
            ]
            if not owners or time.time() >= deadline:
                continue
            slot = rng.choice(owners)
            os.kill(workers[slot].pid, signal.SIGKILL)
            workers[slot].join()
            killed += 1
            if deadline - time.time() > 0.5:
                workers[slot] = start(slot)
    finally:
        for worker in workers:
            worker.join(max(5.0, deadline - time.time() + 30))
            if worker.is_alive():
                worker.kill()
                worker.join()
    for namespace in _namespaces(namespaces):
        remove_stale_segments(namespace, shm_dir=shm_dir)

    def total(field: int) -> int:
        return sum(counters[s * _FIELDS + field] for s in range(processes))

    return StressResult(
        processes=processes,
        seconds=seconds,
        claims=total(_CLAIMS),
        releases=total(_RELEASES),
        conflicts=total(_CONFLICTS),
        owners_killed=killed,
        live_touched=total(_TOUCHED),
        leftovers=_leftovers(shm_dir),
    )


def _bounded(kind, low, high):
    def parse(text: str):
        value = kind(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {low} to {high}")
        return value

    return parse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=_bounded(int, 1, 256), default=8)
    parser.add_argument("--seconds", type=_bounded(float, 0.5, 3600), default=40.0)
    parser.add_argument("--namespaces", type=_bounded(int, 1, 64), default=3)
    parser.add_argument("--ranks", type=_bounded(int, 1, 64), default=4)
    parser.add_argument("--kill-interval", type=_bounded(float, 0.05, 60), default=0.7)
    parser.add_argument("--seed", type=_bounded(int, 0, 2**31), default=0)
    args = parser.parse_args()

    shm_dir = tempfile.mkdtemp(prefix="sglang-shm-stress-", dir="/dev/shm")
    try:
        result = run(
            processes=args.processes,
            seconds=args.seconds,
            shm_dir=shm_dir,
            namespaces=args.namespaces,
            ranks=args.ranks,
            kill_interval=args.kill_interval,
            seed=args.seed,
        )
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    print(f"processes             {result.processes} x {result.seconds:g} s")
    print(f"claims                {result.claims}")
    print(f"releases              {result.releases}")
    print(f"refused (live owner)  {result.conflicts}")
    print(f"owners killed         {result.owners_killed}")
    print(f"live segments touched {result.live_touched}")
    print(f"left behind           {len(result.leftovers)} {list(result.leftovers)[:5]}")
    sys.exit(1 if result.live_touched or result.leftovers else 0)


if __name__ == "__main__":
    main()
