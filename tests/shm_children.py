"""Process bodies for the shared-memory hardening tests (spawn targets): claim, plant and hold as any uid.

Kept apart from the test module so a child imports only this and the package, not pytest.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Optional

from bootstrap_children import _capture_logs

from sglang.srt.distributed.shm_namespace import ShmNamespace
from sglang.srt.distributed.shm_segments import claim_segment, release_shm_collective


def run_as(uid: Optional[int], gid: Optional[int], conn, body: str, *args) -> None:
    """Become ``uid``/``gid`` (None: stay), run ``body(conn, *args)`` and send
    ``("ok", result, logs)`` or ``("error", type name, message, logs)``."""
    lines = _capture_logs()
    try:
        if gid is not None:
            os.setgroups([gid])
            os.setresgid(gid, gid, gid)
        if uid is not None:
            os.setresuid(uid, uid, uid)
        result = globals()[body](conn, *args)
        conn.send(("ok", result, lines.lines))
    except BaseException as exc:
        conn.send(
            (
                "error",
                type(exc).__name__,
                f"{exc}\n{traceback.format_exc()}",
                lines.lines,
            )
        )


def segment_content(rank: int) -> bytes:
    """What a holder writes into its segment: enough to tell whose it is."""
    return f"pid {os.getpid()} rank {rank}\n".encode()


HELPER_TITLE = "sglang-test-helper"


def claim(
    conn, shm_dir: str, port: int, rank: int, hold: bool, wait_s: float = 0.0
) -> dict:
    """Claim ``rank`` of ``127.0.0.1:port``, then write the segment as the kernel would.

    With ``hold``, report ``("claimed", ...)`` and wait for the parent to say
    ``release`` (or to SIGKILL this process).
    """
    namespace = ShmNamespace(addr="127.0.0.1", port=port)
    claim_segment(namespace, rank=rank, shm_dir=shm_dir, wait_s=wait_s)
    segment = os.path.join(shm_dir, namespace.segment_name(rank))
    fd = os.open(segment, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, segment_content(rank))
    finally:
        os.close(fd)
    info = {"pid": os.getpid(), "uid": os.getuid(), "segment": segment}
    if hold:
        conn.send(("claimed", info))
        conn.recv()
        release_shm_collective(namespace, rank=rank)
    return info


def claim_with_helper(conn, shm_dir: str, port: int, rank: int) -> None:
    """Claim, then fork a helper that inherits the owner record's open file, and with
    it the lock, as any process the engine forks without exec does; report
    ``("claimed", {..., "helper": pid})`` and wait to be SIGKILLed.

    The helper renames itself (so a message can be checked for its command line)
    and exits by itself after five minutes, should nobody kill it.
    """
    info = claim(conn, shm_dir, port, rank, False)
    helper = os.fork()
    if helper == 0:
        try:
            import setproctitle

            setproctitle.setproctitle(HELPER_TITLE)
            time.sleep(300)
        finally:
            os._exit(0)
    conn.send(("claimed", {**info, "helper": helper}))
    conn.recv()


def plant(conn, path: str, kind: str) -> str:
    """Create ``path`` as a directory (``dir``/``dir0770``), a file or a symlink to a
    directory of this uid, the way another user could in a sticky ``/dev/shm``."""
    if kind in ("dir", "dir0770"):
        os.mkdir(path, 0o700)
        if kind == "dir0770":
            os.chmod(path, 0o770)
    elif kind == "file":
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        os.close(fd)
    elif kind == "symlink":
        target = path + ".target"
        os.mkdir(target, 0o700)
        os.symlink(target, path)
    else:
        raise ValueError(f"kind={kind!r}")
    return path
