"""A full, a too small and a read-only /dev/shm: errors that name the file and the fix.

Each scenario runs two ranks of a TP 2 engine in a private mount namespace (``unshare
--mount``, which needs root) with a real small tmpfs mounted over /dev/shm; the host's
/dev/shm is never touched. The kernel is the stand-in (a 64 KiB segment), or the CPU
kernel named by ``SGLANG_CPU_KERNEL``: the sizes follow the segment it maps.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sglang.srt.distributed.shm_namespace import ShmNamespace

SCRIPT = Path(__file__).resolve().parent / "shm_mount_children.py"
PORT = 41100  # shm_mount_children.PORT
NAMES = [ShmNamespace(addr="127.0.0.1", port=PORT).segment_name(r) for r in (0, 1)]


@pytest.fixture(scope="module")
def private_mounts():
    """Skips (saying why) only where this host cannot make a private mount namespace."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to mount a small tmpfs over /dev/shm in a namespace")
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if probe.returncode != 0:
        pytest.skip(
            f"mount namespaces are unavailable here (`unshare --mount` exited "
            f"{probe.returncode}: {probe.stderr.strip()}); these tests need root or "
            f"CAP_SYS_ADMIN"
        )


def run_on_small_tmpfs(scenario: str, size: int) -> dict:
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, str(SCRIPT),
         scenario, str(size), os.readlink("/proc/self/ns/mnt")],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def segment(private_mounts) -> int:
    """The bytes of one rank's segment, as the kernel maps it, with room to spare."""
    result = run_on_small_tmpfs("fits", 1 << 30)
    assert [r.get("error") for r in result["ranks"]] == [None, None]
    # Each rank maps both segments, whole; the names went with the ranks' exit.
    [sizes] = {tuple(r["mapped"]) for r in result["ranks"]}
    assert len(set(sizes)) == 1 and result["listing"] == NAMES
    return sizes[0]


def test_room_for_the_segments_is_no_error(segment):
    result = run_on_small_tmpfs("fits", 2 * segment + (64 << 10))
    assert [r.get("error") for r in result["ranks"]] == [None, None]
    assert [r["kernel_calls"] for r in result["ranks"]] in (
        [["initialize"]] * 2,
        [None] * 2,
    )


def test_a_too_small_dev_shm_is_refused_before_a_peer_touches_the_segment(segment):
    result = run_on_small_tmpfs("small", segment + (segment >> 1))
    errors = [r["error"] for r in result["ranks"] if "error" in r]
    # A rank that wrote a short segment says so, and by how much (both may have).
    assert errors
    for kind, message in errors:
        assert kind == "ShmCollectiveError"
        missing = int(re.search(r"needs (\d+) bytes more", message).group(1))
        assert 0 < missing < segment and "/dev/shm has " in message
        assert "mount -o remount,size=" in message and "--shm-size=" in message
    # Both names stay: the released kernel's peers wait for a name as long as they
    # live, and the next engine on this address reuses it.
    assert result["listing"] == NAMES


def test_a_full_dev_shm_names_the_bytes_free_and_the_fix(private_mounts):
    result = run_on_small_tmpfs("full", 1 << 20)
    assert result["filled"] > 0
    for rank in result["ranks"]:
        kind, message = rank["error"]
        assert kind == "ShmCollectiveError"
        assert message.startswith(f"rank {rank['rank']}: /dev/shm has 0 of ")
        assert "mount -o remount,size=" in message and "--shm-size=" in message
        assert rank["kernel_calls"] in ([], None)  # a crash there, without the check
    assert result["listing"] == [*NAMES, "filler"]


def test_a_read_only_dev_shm_names_the_path_and_the_fix(private_mounts):
    result = run_on_small_tmpfs("read-only", 1 << 20)
    for rank, name in zip(result["ranks"], NAMES):
        kind, message = rank["error"]
        assert kind == "ShmCollectiveError"
        assert message.startswith(
            f"rank {rank['rank']}: cannot create '/dev/shm/{name}': /dev/shm is mounted "
            f"read-only"
        )
        assert "`mount -o remount,rw /dev/shm`" in message
        assert rank["kernel_calls"] in ([], None)
