"""Runs one shared-memory scenario on a small tmpfs mounted over /dev/shm.

    unshare --mount --propagation private python shm_mount_children.py SCENARIO PARENT_NS

must start it: the mount lives in the private mount namespace of this process
only and ends with it; the host's /dev/shm is never touched. PARENT_NS is the
starter's ``/proc/self/ns/mnt``; the script refuses to mount anything while its own
namespace is that one. Prints one JSON line:
what ``init_shm_collective`` (with the stand-in kernel) did.

Scenarios: ``fits`` (room for one segment), ``small`` (16 MiB, as a container's
/dev/shm can be), ``full`` (the tmpfs is filled up first), ``read-only``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import shm_kernel_standin as kernel  # noqa: E402

SHM = "/dev/shm"
PORT = 41100
_MOUNT_OPTIONS = {
    "fits": "size=80m,mode=1777",
    "small": "size=16m,mode=1777",
    "full": "size=1m,mode=1777",
    "read-only": "size=1m,mode=1777,ro",
}


def _mount(options: str, *, parent_ns: str) -> None:
    if os.readlink("/proc/self/ns/mnt") == parent_ns:
        raise SystemExit(
            f"not in a private mount namespace ({parent_ns}): start this script "
            f"under `unshare --mount --propagation private`"
        )
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", SHM],
        check=True,
        capture_output=True,
        text=True,
    )


def _fill() -> int:
    """Write a file until the tmpfs is full; its size in bytes."""
    written = 0
    block = b"\0" * 4096
    fd = os.open(os.path.join(SHM, "filler"), os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        while True:
            try:
                written += os.write(fd, block)
            except OSError:
                return written
    finally:
        os.close(fd)


def main(scenario: str, parent_ns: str) -> None:
    _mount(_MOUNT_OPTIONS[scenario], parent_ns=parent_ns)
    filled = _fill() if scenario == "full" else 0
    from sglang.srt.distributed.shm_collective import (
        ShmNamespace,
        init_shm_collective,
        unlink_shm_segments,
    )

    namespace = ShmNamespace(addr="127.0.0.1", port=PORT)
    tp_size = 1 if scenario == "fits" else 2
    result = {"scenario": scenario, "filled": filled, "tp_size": tp_size}
    with kernel.registered("released") as calls:
        try:
            result["initialised"] = init_shm_collective(
                namespace, tp_size=tp_size, tp_rank=0
            )
        except Exception as exc:  # reported to the test, which judges it
            result["error"] = [type(exc).__name__, str(exc)]
        result["kernel_calls"] = [c["op"] for c in calls]
    result["listing"] = sorted(
        os.path.relpath(os.path.join(root, name), SHM)
        for root, dirs, files in os.walk(SHM)
        for name in dirs + files
    )
    result["unlinked"] = unlink_shm_segments()
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
