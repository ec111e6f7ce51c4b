"""A stand-in for the CPU build of ``sgl_kernel``'s shared-memory collective.

This module registers ops of the same names and schemas as the real CPU kernel with
``torch.library`` (tests that need no compiler use it; tests/test_shm_kernel.py runs
the real one) and makes the same ``/dev/shm`` traffic:

* ``initialize(int size, int rank) -> ()`` (the released schema) reads
  ``LOCAL_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` from the C environment
  (``getenv``, as the C++ code does), and sets up shared memory only when
  ``LOCAL_SIZE == size``;
* ``initialize.group(int size, int rank, str namespace, str group, float timeout)
  -> ()`` (the overload of upstream_prs/0002, beside the released op): the group's own
  segments ``<namespace>_<group>_<rank>``, all ranks set up or none;
* ``init_cpu_threads_env(str cpu_ids) -> str`` pins the process and sets the
  thread count;
* ``shm_allreduce(Tensor(a!) data, int reduce_op) -> ()`` sums ``data`` over the
  ranks through the mapped segments (registered with ``all_reduce=True``), which is
  what ``parallel_state``'s ``GroupCoordinator.all_reduce`` calls when
  ``is_shm_available`` says yes.

Released set-up is the CPU build's ``shm.cpp``: its three ``shm_open`` calls, all in
the one-time ``initialize`` (a second one in a process does nothing): this rank's
segment with ``O_CREAT | O_RDWR`` and mode 0600 but no ``O_EXCL`` (a leftover file of
that name is reused), a fresh workspace written into it (unchecked: a short write maps
short), the same name opened again and mapped for the bytes written, then each peer's
segment opened in a loop that retries at once on ENOENT and never gives up in the real
kernel; here only a test deadline (``SHM_STANDIN_PEER_DEADLINE_S``, default 120 s) ends
it, so that a test cannot hang. Nothing is ever unlinked. Group set-up is the patched
kernel's, simplified: its own segment made whole before it has a name (``O_TMPFILE``,
then a link: an existing name is an error naming it), each peer's opened with a pause
between tries until ``timeout``, an "arrived" byte set once every peer is mapped, and
its own name unlinked once every rank has arrived; on any failure its own name goes.
Mappings are ``mmap`` of the full size, whatever the file's size, as in C.
``torch.library`` definitions live per process and one name can be defined once, so
every process (the test process and each spawned child) calls :func:`register` itself,
and :func:`unregister` before switching schema.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import struct
import time
from typing import Iterator, Optional

SHM_DIR = "/dev/shm"
WORKSPACE_BYTES = 65536
_MAGIC = b"SGLSTAND"
# magic, pid, rank, size, 200-byte prefix.
_HEADER = struct.Struct("<8sqii200s")
# Two all-reduce slots (a sequence number, then up to 127 float64 values): a rank
# writes call n into slot n % 2, so it never overwrites a slot a peer still reads.
_SLOT_OFFSET = 1024
# Group set-up: the owner's "arrived" byte, once it has mapped every peer.
_ARRIVED_OFFSET = 512
_SLOT_BYTES = 1536
_SLOT_VALUES = _SLOT_BYTES // 8 - 1
_SEQUENCE = struct.Struct("<q")

SCHEMAS = {
    "released": "initialize(int size, int rank) -> ()",
    # upstream_prs/0002: the released op, and an overload for a group
    "group": "initialize.group(int size, int rank, str namespace, str group, "
    "float timeout) -> ()",
}

CALLS: list[dict] = []
"""One entry per ``initialize``/``init_cpu_threads_env`` call in this process."""

FAIL_NEXT: list[BaseException] = []
"""Put an exception here to make the next ``initialize`` raise it (after reading its inputs)."""

_state: dict = {
    "lib": None,
    "schema": None,
    "prefix": None,
    "rank": None,
    "maps": {},
    "fds": [],
    "sequence": 0,
}
_libc = ctypes.CDLL(None, use_errno=True)
_libc.getenv.restype = ctypes.c_char_p
_libc.getenv.argtypes = [ctypes.c_char_p]
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]  # fmt: skip
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_LENGTHS: dict[int, int] = {}  # each mapping's address and length, for munmap
# glibc's shm_open adds O_NOFOLLOW and O_CLOEXEC to the flags it is given.
_SHM_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


def c_getenv(name: str) -> Optional[str]:
    """The variable as C code in this process sees it."""
    value = _libc.getenv(name.encode())
    return None if value is None else value.decode()


def _map(fd: int, length: int = WORKSPACE_BYTES) -> ctypes.Array:
    """``mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)``: past the end
    of a shorter file the mapping exists, and touching it is a SIGBUS, as in C."""
    address = _libc.mmap(
        None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0
    )
    if address in (None, _MAP_FAILED):
        raise OSError(ctypes.get_errno(), "stand-in kernel: mmap failed")
    _LENGTHS[address] = length
    return (ctypes.c_char * WORKSPACE_BYTES).from_address(address)


def _open_peer(path: str, rank: int, deadline: float, group: bool) -> int:
    while True:
        try:
            # shm_open 3 (shared_open in a loop while errno == ENOENT).
            return os.open(path, os.O_RDWR | _SHM_OPEN_FLAGS)
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"stand-in kernel: rank {rank} still waits for {path} at the "
                    f"deadline"
                ) from None
            # The released loop does not even yield; the group one pauses.
            time.sleep(0.001) if group else os.sched_yield()


def _workspace(prefix: str, rank: int, size: int) -> bytes:
    workspace = bytearray(WORKSPACE_BYTES)
    _HEADER.pack_into(workspace, 0, _MAGIC, os.getpid(), rank, size, prefix.encode())
    return bytes(workspace)


def _released_set_up(size: int, rank: int, prefix: str) -> None:
    own = os.path.join(SHM_DIR, f"{prefix}_{rank}")
    # shm_open 1: no O_EXCL, so a leftover is reused; the write is not checked.
    fd = os.open(own, os.O_CREAT | os.O_RDWR | _SHM_OPEN_FLAGS, 0o600)
    written = os.write(fd, _workspace(prefix, rank, size))
    os.close(fd)
    # shm_open 2 (shared_open): the same name opened again, mapped for what was written.
    fd = os.open(own, os.O_RDWR | _SHM_OPEN_FLAGS)
    _state["fds"].append(fd)
    maps = {rank: _map(fd, written)}
    deadline = time.monotonic() + float(
        os.environ.get("SHM_STANDIN_PEER_DEADLINE_S", "120")
    )
    for peer in (p for p in range(size) if p != rank):
        fd = _open_peer(
            os.path.join(SHM_DIR, f"{prefix}_{peer}"), rank, deadline, False
        )
        _state["fds"].append(fd)
        maps[peer] = _map(fd)
    _state.update(prefix=prefix, rank=rank, maps=maps)


def _group_set_up(size: int, rank: int, prefix: str, timeout: float) -> None:
    own = os.path.join(SHM_DIR, f"{prefix}_{rank}")
    fd = os.open(SHM_DIR, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    _state["fds"].append(fd)
    os.write(fd, _workspace(prefix, rank, size))
    # linkat(AT_FDCWD, "/proc/self/fd/N", AT_FDCWD, own, AT_SYMLINK_FOLLOW), as the
    # kernel does (os.link would link the /proc symlink itself).
    if _libc.linkat(-100, f"/proc/self/fd/{fd}".encode(), -100, own.encode(), 0x400):
        error = ctypes.get_errno()
        raise RuntimeError(f"stand-in kernel: {own} exists: {os.strerror(error)}")
    maps = {rank: _map(fd)}
    deadline = time.monotonic() + timeout
    try:
        for peer in (p for p in range(size) if p != rank):
            path = os.path.join(SHM_DIR, f"{prefix}_{peer}")
            fd = _open_peer(path, rank, deadline, True)
            _state["fds"].append(fd)
            maps[peer] = _map(fd)
        maps[rank][_ARRIVED_OFFSET] = b"\x01"
        while any(m[_ARRIVED_OFFSET] != b"\x01" for m in maps.values()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"stand-in kernel: {prefix} did not all arrive")
            time.sleep(0.001)
    finally:
        os.unlink(own)  # every rank has mapped it, or this one failed
    _state.update(prefix=prefix, rank=rank, maps=maps)


def _record(entry: dict) -> None:
    CALLS.append(entry)
    if FAIL_NEXT:
        raise FAIL_NEXT.pop(0)


def _initialize_released(size: int, rank: int) -> None:
    seen = {
        name: c_getenv(name) for name in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE")
    }
    addr, port = seen["MASTER_ADDR"] or "", seen["MASTER_PORT"] or ""
    prefix = f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}"
    _record(
        {
            "op": "initialize",
            "schema": _state["schema"],
            "size": size,
            "rank": rank,
            "segment": f"{prefix}_{rank}",
            "env": seen,
        }
    )
    if _state["prefix"] is not None:
        return
    local_size = int(seen["LOCAL_SIZE"]) if seen["LOCAL_SIZE"] else 0
    if size >= 1 and size == local_size:
        _released_set_up(size, rank, prefix)


def _initialize_group(
    size: int, rank: int, namespace: str = "", group: str = "", timeout: float = 0
) -> None:
    if not namespace:
        return _initialize_released(size, rank)
    seen = {
        name: c_getenv(name) for name in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE")
    }
    prefix = f"{namespace}_{group}"
    _record(
        {
            "op": "initialize",
            "schema": "group",
            "size": size,
            "rank": rank,
            "group": group,
            "timeout": timeout,
            "segment": f"{prefix}_{rank}",
            "env": seen,
        }
    )
    if _state["prefix"] is None:
        _group_set_up(size, rank, prefix, timeout)


def _parse_cpulist(text: str) -> set[int]:
    """``"0-3,8"`` as a set; here, not from the package, so that the stand-in also
    serves the pristine sglang (which has no cpulist parser of its own)."""
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def _init_cpu_threads_env(cpu_ids: str) -> str:
    import torch

    cpus = _parse_cpulist(cpu_ids)
    _record({"op": "init_cpu_threads_env", "cpu_ids": cpu_ids})
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
    return f"stand-in bound {len(cpus)} threads to {cpu_ids}"


def _wait_for_sequence(
    m: ctypes.Array, offset: int, sequence: int, deadline: float
) -> None:
    while _SEQUENCE.unpack_from(m, offset)[0] != sequence:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"stand-in kernel: a peer never wrote all-reduce {sequence}"
            )
        time.sleep(0.0005)


def _shm_allreduce(data, reduce_op: int) -> None:
    import torch

    _record({"op": "shm_allreduce", "numel": data.numel(), "dtype": str(data.dtype)})
    if reduce_op != int(torch.distributed.ReduceOp.SUM):
        raise RuntimeError(f"stand-in kernel: reduce_op {reduce_op} is not SUM")
    maps = _state["maps"]
    if not maps:
        raise RuntimeError(
            "stand-in kernel: shm_allreduce before initialize set up shared memory"
        )
    values = data.reshape(-1).to(torch.float64).tolist()
    if len(values) > _SLOT_VALUES:
        raise RuntimeError(
            f"stand-in kernel: at most {_SLOT_VALUES} values per all-reduce"
        )
    _state["sequence"] += 1
    sequence = _state["sequence"]
    offset = _SLOT_OFFSET + (sequence % 2) * _SLOT_BYTES
    own = maps[_state["rank"]]
    struct.pack_into(f"<{len(values)}d", own, offset + 8, *values)
    _SEQUENCE.pack_into(own, offset, sequence)  # after the values: peers read them next
    deadline = time.monotonic() + 60
    total = [0.0] * len(values)
    for rank, m in sorted(maps.items()):
        _wait_for_sequence(m, offset, sequence, deadline)
        peer = struct.unpack_from(f"<{len(values)}d", m, offset + 8)
        total = [a + b for a, b in zip(total, peer)]
    data.copy_(
        torch.tensor(total, dtype=torch.float64).reshape(data.shape).to(data.dtype)
    )


def register(
    schema: str, *, threads_env: bool = False, all_reduce: bool = False
) -> None:
    """Define ``sgl_kernel::initialize`` with ``schema`` ("released" or "group") in
    this process, ``init_cpu_threads_env`` too if ``threads_env``, and
    ``shm_allreduce`` if ``all_reduce``."""
    import torch

    if _state["lib"] is not None:
        raise RuntimeError(
            f"stand-in already registered ({_state['schema']}); unregister first"
        )
    lib = torch.library.Library("sgl_kernel", "DEF")
    lib.define(SCHEMAS["released"])
    lib.impl("initialize", _initialize_released, "CompositeExplicitAutograd")
    if schema == "group":
        lib.define(SCHEMAS["group"])
        lib.impl("initialize.group", _initialize_group, "CompositeExplicitAutograd")
    if threads_env:
        lib.define("init_cpu_threads_env(str cpu_ids) -> str")
        lib.impl(
            "init_cpu_threads_env", _init_cpu_threads_env, "CompositeExplicitAutograd"
        )
    if all_reduce:
        lib.define("shm_allreduce(Tensor(a!) data, int reduce_op) -> ()")
        lib.impl("shm_allreduce", _shm_allreduce, "CompositeExplicitAutograd")
    _state.update(lib=lib, schema=schema)


def unregister() -> None:
    """Remove the ops and forget the kernel's per-process state (maps closed)."""
    lib = _state["lib"]
    if lib is not None:
        lib._destroy()
    for m in _state["maps"].values():
        _libc.munmap(ctypes.addressof(m), _LENGTHS.pop(ctypes.addressof(m)))
    for fd in _state["fds"]:
        os.close(fd)
    _state.update(
        lib=None, schema=None, prefix=None, rank=None, maps={}, fds=[], sequence=0
    )
    CALLS.clear()
    FAIL_NEXT.clear()


@contextlib.contextmanager
def registered(
    schema: str, *, threads_env: bool = False, all_reduce: bool = False
) -> Iterator[list[dict]]:
    register(schema, threads_env=threads_env, all_reduce=all_reduce)
    try:
        yield CALLS
    finally:
        unregister()


def peer_prefixes() -> dict[int, str]:
    """The prefix each mapped segment's writer used (proves whose segment it is)."""
    result = {}
    for rank, m in _state["maps"].items():
        magic, _pid, _rank, _size, prefix = _HEADER.unpack_from(m, 0)
        assert magic == _MAGIC
        result[rank] = prefix.rstrip(b"\0").decode()
    return result
