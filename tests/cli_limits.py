"""Running `python -m sglang.srt.placement_tools` on bad input without letting a missing bound harm the host.

``run_cli`` starts the command under a 6 GiB address-space limit and a timeout; ``memory_cap`` caps this
process's own address space (for in-process calls) for a block; ``deadline`` turns a hang into an exception;
``assert_usage_error`` checks the contract for bad input: exit 2, one printable line, no traceback.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import resource
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Iterator

CLI = [sys.executable, "-m", "sglang.srt.placement_tools"]
MEMORY_LIMIT = 6 << 30  # torch, which numa_utils imports, maps 3.5 GiB


def clean_env(extra=None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SGLANG_") and k != "CUDA_VISIBLE_DEVICES"
    }
    env.update(extra or {})
    return env


def run_cli(*args, env=None, timeout=15, file_size=None):
    """Run the CLI with ``args``; the result has ``seconds`` besides returncode, stdout and stderr."""

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
        if file_size is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))

    start = time.monotonic()
    done = subprocess.run(
        [*CLI, *map(str, args)],
        capture_output=True,
        text=True,
        env=clean_env(env),
        timeout=timeout,
        preexec_fn=limit,
    )
    done.seconds = time.monotonic() - start
    return done


def assert_usage_error(done, *fragments):
    """Exit 2, one line on stderr starting with ``error:``, holding each fragment, no traceback."""
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    return assert_one_line(done.stderr, *fragments)


def assert_one_line(stderr: str, *fragments) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("error: "), lines[0]
    assert lines[0].isprintable(), repr(lines[0])
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


@contextlib.contextmanager
def memory_cap(extra: int = MEMORY_LIMIT) -> Iterator[None]:
    """Let this process map at most ``extra`` more bytes in the block: a MemoryError, not the OOM killer."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = (
        mapped + extra if hard == resource.RLIM_INFINITY else min(mapped + extra, hard)
    )
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


class Hang(Exception):
    """A call ran past its deadline."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise Hang in the block after ``seconds`` (main thread only: SIGALRM), also inside a blocking open()."""

    def expire(signum, frame):
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def in_child(
    fn: Callable[..., Any], *args: Any, seconds: float = 20.0
) -> tuple[str, Any]:
    """Call ``fn(*args)`` in a forked child under ``memory_cap`` and ``deadline``, so that whatever it holds is
    gone with it; return ``("ok", result)`` or ``(exception type name, message)``."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(read_end)
            try:
                with memory_cap(), deadline(seconds):
                    outcome = ("ok", fn(*args))
            except BaseException as exc:  # noqa: B902 - reported to the parent
                outcome = (type(exc).__name__, str(exc))
            with os.fdopen(write_end, "wb") as pipe:
                pipe.write(pickle.dumps(outcome))
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    return pickle.loads(data) if data else ("died", "")
