"""A full, a too small and a read-only /dev/shm: errors that name the file and the fix.

Each scenario runs in a private mount namespace (``unshare --mount``, which needs
root) with a real small tmpfs mounted over /dev/shm, so the kernel itself says
ENOSPC or EROFS; the host's /dev/shm is never touched.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sglang.srt.distributed.shm_collective import (
    KERNEL_SEGMENT_BYTES,
    segment_bytes_missing,
)
from sglang.srt.distributed.shm_namespace import ShmNamespace

SCRIPT = Path(__file__).resolve().parent / "shm_mount_children.py"
PORT = 41100  # shm_mount_children.PORT
SEGMENT = f"/dev/shm/{ShmNamespace(addr='127.0.0.1', port=PORT).segment_name(0)}"


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


def run_on_small_tmpfs(scenario: str) -> dict:
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, str(SCRIPT),
         scenario, os.readlink("/proc/self/ns/mnt")],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_room_for_the_segment_is_no_error(private_mounts):
    result = run_on_small_tmpfs("fits")  # 80 MiB: one rank's 66 MiB fits
    assert result.get("error") is None and result["initialised"] is True
    assert result["kernel_calls"] == ["initialize"]
    assert result["unlinked"] == [SEGMENT]


def test_a_too_small_dev_shm_is_refused_before_the_kernel_runs(private_mounts):
    result = run_on_small_tmpfs("small")  # 16 MiB, for a TP 2 engine
    kind, message = result["error"]
    assert kind == "ShmCollectiveError"
    assert f"needs {2 * KERNEL_SEGMENT_BYTES} bytes more" in message
    assert f"{KERNEL_SEGMENT_BYTES} bytes, about 66 MiB" in message
    assert repr(SEGMENT) in message and "'/dev/shm' has " in message
    free, total = map(
        int, re.search(r"has (\d+) of (\d+) bytes free", message).groups()
    )
    assert total == 16 << 20 and free <= total
    size = -(-(total - free + 2 * KERNEL_SEGMENT_BYTES) // (1 << 20))  # MiB, rounded up
    assert f"`mount -o remount,size={size}M /dev/shm`" in message
    assert f"--shm-size={size}m" in message
    # The kernel never ran (it would write a short segment its peers then map),
    # and the refused rank left nothing behind.
    assert result["kernel_calls"] == [] and result["listing"] == []


def test_a_full_dev_shm_names_the_bytes_free_and_needed(private_mounts):
    result = run_on_small_tmpfs("full")
    assert result["filled"] > 0
    kind, message = result["error"]
    assert kind == "ShmCollectiveError"
    assert message.startswith("rank 0: '/dev/shm' has 0 of ")
    assert f"needs {2 * KERNEL_SEGMENT_BYTES} bytes more" in message
    assert repr(SEGMENT) in message
    assert "mount -o remount,size=" in message and "--shm-size=" in message
    assert "No space left" not in message
    assert result["kernel_calls"] == [] and result["listing"] == ["filler"]


def test_a_read_only_dev_shm_names_the_path_and_the_fix(private_mounts):
    result = run_on_small_tmpfs("read-only")
    kind, message = result["error"]
    assert kind == "ShmCollectiveError"
    assert message.startswith(
        f"rank 0: cannot create {SEGMENT!r}: '/dev/shm' is mounted read-only"
    )
    assert "`mount -o remount,rw /dev/shm`" in message
    assert result["kernel_calls"] == []


# ------------------------------------------------------------------------------- pure parts


def test_bytes_still_to_write_count_absent_and_short_segments():
    segment = KERNEL_SEGMENT_BYTES
    assert segment == 2 * 4 + 2 * (1 << 20) + 2 * (32 << 20)
    assert segment_bytes_missing([None, None]) == 2 * segment
    assert segment_bytes_missing([segment, None]) == segment
    assert segment_bytes_missing([4096, segment + 1]) == segment - 4096
    assert segment_bytes_missing([]) == 0
