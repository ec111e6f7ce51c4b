"""One rank of a CPU kernel group, for tests/test_shm_group_portable.py.

    python shm_group_rank.py SPEC_JSON

SPEC names the kernel (``backend``: ``driver``, the C ABI test driver built from the
patch's ``shm_group.cpp``, or ``kernel``, a ``common_ops*.so`` whose ``initialize`` takes
a group), then ``size``, ``rank``, ``namespace``, ``group``, ``timeout`` and ``value``.
Optional: ``umask``; ``fsize`` (RLIMIT_FSIZE in bytes: the workspace cannot be allocated);
``fork_child_s`` (once this rank's segment is named, a thread forks a child that sleeps
that long); ``joins`` (more ``[size, rank, namespace, group, timeout]`` calls after the
first). It prints one JSON line: its pid, each call's error (``None`` when it returned),
the sum of ``value`` over the group, and ``time.monotonic()`` at its start, at its first
call and when the calls ended.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys
import threading
import time

DRIVER_BYTES = 1 << 20  # the driver's workspace per rank


class Driver:
    def __init__(self, library: str) -> None:
        self.lib = ctypes.CDLL(library)
        self.lib.driver_join.restype = ctypes.c_char_p
        self.lib.driver_join.argtypes = [ctypes.c_int64, ctypes.c_int64,
                                         ctypes.c_char_p, ctypes.c_char_p,
                                         ctypes.c_double, ctypes.c_uint64]  # fmt: skip
        self.lib.driver_allreduce.restype = ctypes.c_double
        self.lib.driver_allreduce.argtypes = [ctypes.c_double]

    def join(self, size, rank, namespace, group, timeout) -> str | None:
        error = self.lib.driver_join(size, rank, namespace.encode(), group.encode(),
                                     timeout, DRIVER_BYTES)  # fmt: skip
        return error.decode() if error is not None else None

    def allreduce(self, value: float) -> float:
        return self.lib.driver_allreduce(value)


class Kernel:
    def __init__(self, library: str) -> None:
        import torch

        torch.ops.load_library(library)
        self.torch = torch
        self.ops = torch.ops.sgl_kernel

    def join(self, size, rank, namespace, group, timeout) -> str | None:
        try:
            self.ops.initialize(size, rank, namespace, group, timeout)
        except RuntimeError as exc:
            return str(exc).splitlines()[0]
        return None

    def allreduce(self, value: float) -> float:
        """fp32 (the small-message path) and bf16 1 MiB (the large one) must agree."""
        small = self.torch.full((32,), value, dtype=self.torch.float32)
        large = self.torch.full((1 << 19,), value, dtype=self.torch.bfloat16)
        for data in (small, large):
            self.ops.shm_allreduce(data, 0)  # ReduceOp.SUM
        sums = {float(small[0]), float(small[-1]), float(large[0]), float(large[-1])}
        return sums.pop() if len(sums) == 1 else -1.0


def fork_a_child_once_named(path: str, seconds: float) -> None:
    def fork() -> None:
        while not os.path.exists(path):
            time.sleep(0.001)
        if os.fork() == 0:  # a helper: sleeps, touches nothing
            time.sleep(seconds)
            os._exit(0)

    threading.Thread(target=fork, daemon=True).start()


def main() -> None:
    spec = json.loads(sys.argv[1])
    started = time.monotonic()
    if "umask" in spec:
        os.umask(spec["umask"])
    if "fsize" in spec:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (spec["fsize"], spec["fsize"]))
    kernel = (Driver if spec["backend"] == "driver" else Kernel)(spec["library"])
    call = [spec[k] for k in ("size", "rank", "namespace", "group", "timeout")]
    if "fork_child_s" in spec:
        path = f"/dev/shm/{spec['namespace']}_{spec['group']}_{spec['rank']}"
        fork_a_child_once_named(path, spec["fork_child_s"])
    called = time.monotonic()
    errors = [kernel.join(*args) for args in [call, *spec.get("joins", [])]]
    ended = time.monotonic()
    total = kernel.allreduce(spec["value"]) if errors[0] is None else None
    print(json.dumps({"pid": os.getpid(), "errors": errors, "sum": total,
                      "started": started, "called": called, "ended": ended}),
          flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
