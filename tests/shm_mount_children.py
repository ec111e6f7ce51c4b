"""Runs one shared-memory scenario on a small tmpfs mounted over /dev/shm.

    unshare --mount --propagation private python shm_mount_children.py SCENARIO SIZE PARENT_NS

must start it: the mount lives in the private mount namespace of this process
only and ends with it; the host's /dev/shm is never touched. PARENT_NS is the
starter's ``/proc/self/ns/mnt``; the script refuses to mount anything while its own
namespace is that one. SIZE is the tmpfs's size (mount's ``size=``). Two ranks of one
engine (this process and a forked one) then run ``init_shm_collective`` on the kernel
named by ``SGLANG_CPU_KERNEL``, or on the stand-in; it prints one JSON line: what each
rank got, and what /dev/shm holds.

Scenarios: ``fits``, ``small`` (room for less than two segments), ``full`` (the tmpfs
is filled up first), ``read-only``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import shm_kernel_standin as kernel  # noqa: E402

SHM = "/dev/shm"
PORT = 41100


def _mount(options: str, *, parent_ns: str) -> None:
    if os.readlink("/proc/self/ns/mnt") == parent_ns:
        raise SystemExit(
            f"not in a private mount namespace ({parent_ns}): start this script "
            f"under `unshare --mount --propagation private`"
        )
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", SHM],
                   check=True, capture_output=True, text=True)  # fmt: skip


def _fill() -> int:
    """Write a file until the tmpfs is full; its size in bytes."""
    written = 0
    fd = os.open(os.path.join(SHM, "filler"), os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        while True:
            try:
                written += os.write(fd, b"\0" * 4096)
            except OSError:
                return written
    finally:
        os.close(fd)


def _rank(rank: int, results) -> None:
    from sglang.srt.distributed.shm_collective import (
        ShmNamespace,
        init_shm_collective,
        shm_mappings,
    )

    result: dict = {"rank": rank}
    try:
        namespace = ShmNamespace(addr="127.0.0.1", port=PORT)
        init_shm_collective(namespace, tp_size=2, tp_rank=rank)
        names = [f"{SHM}/{namespace.segment_name(r)}" for r in (0, 1)]
        mapped = shm_mappings().values()
        result["mapped"] = sorted(size for path, size in mapped if path in names)
    except Exception as exc:  # reported to the test, which judges it
        result["error"] = [type(exc).__name__, str(exc)]
    stood_in = not os.environ.get("SGLANG_CPU_KERNEL")  # the real one logs no calls
    result["kernel_calls"] = [c["op"] for c in kernel.CALLS] if stood_in else None
    results.put(result)


def main(scenario: str, size: str, parent_ns: str) -> None:
    results = multiprocessing.get_context("fork").Queue()  # its semaphore: host's
    _mount(f"size={size},mode=1777" + (",ro" if scenario == "read-only" else ""),
           parent_ns=parent_ns)  # fmt: skip
    filled = _fill() if scenario == "full" else 0
    if os.environ.get("SGLANG_CPU_KERNEL"):
        import sgl_kernel  # noqa: F401
    else:
        kernel.register("released")
    os.environ["SHM_STANDIN_PEER_DEADLINE_S"] = "20"
    peer = multiprocessing.get_context("fork").Process(target=_rank, args=(1, results))
    peer.start()
    _rank(0, results)
    ranks = sorted(
        (results.get(timeout=120) for _ in range(2)), key=lambda r: r["rank"]
    )
    peer.join(timeout=60)
    listing = sorted(os.listdir(SHM))
    print(json.dumps({"scenario": scenario, "filled": filled, "ranks": ranks,
                      "listing": listing}))  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:4])
