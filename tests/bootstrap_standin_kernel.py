"""A stand-in for the CPU build of sgl-kernel's shared-memory ops, for bootstrap's tests.

The PyPI sgl-kernel is CUDA-only, and the CPU build needs AVX-512 or AMX: this host
has neither. ``register()`` defines, with ``torch.library``, the ops sglang's CPU path
calls, under their real names and schemas, doing what the CPU build's ``shm.cpp``
does with ``/dev/shm``:

* ``initialize(int size, int rank) -> ()``: once per process. It reads
  ``LOCAL_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` with the C library's
  ``getenv`` at the call (as the C++ code does; absent ones read as ""), and only
  when ``LOCAL_SIZE == size`` sets up shared memory: this rank's segment
  ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``
  opened with ``O_CREAT | O_RDWR`` and mode 0600 but no ``O_EXCL`` (as ``shm_open``:
  a file already there is reused), a fresh workspace written into it, the name
  opened again and mapped, then each peer's segment opened in a loop while it does
  not exist yet, and mapped. It unlinks nothing. It returns once every peer's
  segment is mapped.
* ``init_cpu_threads_env(str cpu_ids) -> str``: pins the process to ``cpu_ids``.
* ``shm_allreduce(Tensor(a!) data, int reduce_op) -> ()``: sums ``data`` over the
  ranks through the mapped segments, which is what ``GroupCoordinator.all_reduce``
  calls when ``is_shm_available`` says yes. Ranks mapping the wrong files sum wrong
  or wait for ever; ``SHM_STANDIN_DEADLINE_S`` (default 120) ends such a wait with
  an error, so that a failing test cannot hang.

``CALLS`` records each call: the op, and for ``initialize`` the variables it read and
the segment it named.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import time
from typing import Optional

SHM_DIR = "/dev/shm"
PREFIX = "deepspeed_allreduce_buffer_"
WATCHED = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE")
# A workspace: a header (magic, pid, rank), then two all-reduce slots, each a call
# number and up to SLOT_VALUES float64 values. Call n uses slot n % 2: a rank writes
# call n + 2 there only after every peer wrote n + 1, so after they read call n.
_HEADER = struct.Struct("<8sqq")
_MAGIC = b"SGLSTAND"
SLOT_VALUES = 4096
_SLOT_BYTES = 8 * (1 + SLOT_VALUES)
_SLOT_OFFSET = 64
WORKSPACE_BYTES = _SLOT_OFFSET + 2 * _SLOT_BYTES
# glibc's shm_open adds these to the flags it is given.
_SHM_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC

CALLS: list[dict] = []
_state: dict = {"lib": None, "maps": None, "rank": None, "calls": 0}
_libc = ctypes.CDLL(None)
_libc.getenv.restype = ctypes.c_char_p
_libc.getenv.argtypes = [ctypes.c_char_p]


def c_getenv(name: str) -> Optional[str]:
    """The variable as C code in this process reads it."""
    value = _libc.getenv(name.encode())
    return None if value is None else value.decode()


def segment_path(addr: str, port: str, rank: int) -> str:
    return os.path.join(SHM_DIR, f"{PREFIX}{os.getuid()}_{addr}_{port}_{rank}")


def _deadline() -> float:
    return time.monotonic() + float(os.environ.get("SHM_STANDIN_DEADLINE_S", "120"))


def _open_peer(path: str, deadline: float) -> int:
    """The peer's segment, once it exists and its owner has written its workspace
    (shm.cpp maps it at once; mmap here refuses a file shorter than the mapping)."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | _SHM_OPEN_FLAGS)
        except FileNotFoundError:
            pass
        else:
            if os.fstat(fd).st_size >= WORKSPACE_BYTES:
                return fd
            os.close(fd)
        if time.monotonic() > deadline:
            raise RuntimeError(f"stand-in kernel: {path} never appeared whole")
        time.sleep(0.001)


def _map(fd: int) -> mmap.mmap:
    try:
        return mmap.mmap(fd, WORKSPACE_BYTES)
    finally:
        os.close(fd)  # the mapping keeps the file


def _initialize(size: int, rank: int) -> None:
    seen = {name: c_getenv(name) for name in WATCHED}
    call = {"op": "initialize", "size": size, "rank": rank, "env": seen}
    CALLS.append(call)
    if _state["maps"] is not None:
        return  # once per process, as shm.cpp
    if (seen["LOCAL_SIZE"] or "") != str(size):
        _state["maps"] = {}
        return
    addr, port = seen["MASTER_ADDR"] or "", seen["MASTER_PORT"] or ""
    own = segment_path(addr, port, rank)
    call["segment"] = own
    fd = os.open(own, os.O_CREAT | os.O_RDWR | _SHM_OPEN_FLAGS, 0o600)
    workspace = bytearray(WORKSPACE_BYTES)
    _HEADER.pack_into(workspace, 0, _MAGIC, os.getpid(), rank)
    os.pwrite(fd, bytes(workspace), 0)
    os.close(fd)
    maps = {rank: _map(os.open(own, os.O_RDWR | _SHM_OPEN_FLAGS))}
    deadline = _deadline()
    for peer in range(size):
        if peer != rank:
            maps[peer] = _map(_open_peer(segment_path(addr, port, peer), deadline))
    _state.update(maps=maps, rank=rank)


def _init_cpu_threads_env(cpu_ids: str) -> str:
    CALLS.append({"op": "init_cpu_threads_env", "cpu_ids": cpu_ids})
    cpus = set()
    for part in cpu_ids.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    os.sched_setaffinity(0, cpus)
    return cpu_ids


def _shm_allreduce(data, reduce_op: int) -> None:
    import torch

    maps, rank = _state["maps"], _state["rank"]
    if not maps:
        raise RuntimeError("stand-in kernel: shm_allreduce before initialize set up")
    values = data.reshape(-1).to(torch.float64).tolist()
    if len(values) > SLOT_VALUES:
        raise ValueError(f"stand-in kernel: at most {SLOT_VALUES} values per call")
    call = _state["calls"] = _state["calls"] + 1
    offset = _SLOT_OFFSET + (call % 2) * _SLOT_BYTES
    own = maps[rank]
    own[offset + 8 : offset + 8 + 8 * len(values)] = struct.pack(
        f"<{len(values)}d", *values
    )
    own[offset : offset + 8] = struct.pack("<q", call)
    total = [0.0] * len(values)
    deadline = _deadline()
    for peer, segment in sorted(maps.items()):
        while struct.unpack_from("<q", segment, offset)[0] != call:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"stand-in kernel: rank {rank} waited for rank {peer}'s call {call}"
                )
            time.sleep(0.0005)
        theirs = struct.unpack_from(f"<{len(values)}d", segment, offset + 8)
        total = [a + b for a, b in zip(total, theirs)]
    CALLS.append({"op": "shm_allreduce", "values": len(values)})
    data.copy_(torch.tensor(total, dtype=torch.float64).reshape(data.shape))


def register() -> None:
    """Define the ops in this process (once)."""
    if _state["lib"] is not None:
        return
    import torch

    lib = torch.library.Library("sgl_kernel", "DEF")
    lib.define("initialize(int size, int rank) -> ()")
    lib.define("init_cpu_threads_env(str cpu_ids) -> str")
    lib.define("shm_allreduce(Tensor(a!) data, int reduce_op) -> ()")
    lib.impl("initialize", _initialize, "CompositeExplicitAutograd")
    lib.impl("init_cpu_threads_env", _init_cpu_threads_env, "CompositeExplicitAutograd")
    lib.impl("shm_allreduce", _shm_allreduce, "CompositeExplicitAutograd")
    _state["lib"] = lib
