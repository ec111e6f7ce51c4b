"""A small ctypes binding of libnuma.so.1, loaded once per process.

Only what placement needs is bound, with Python types in and out. Calls that
libnuma declares ``void`` (``numa_set_membind``, ``numa_set_preferred``) report
failure only through ``numa_error``, which prints to stderr and keeps going; to
see the kernel's answer we call libnuma's ``set_mempolicy`` wrapper with the
same arguments those functions would pass, so a rejected policy raises
``OSError`` instead of being lost.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno as errno_mod
import functools
import logging
import os
import platform
from typing import (
    Any,
    Callable,
    Iterable,
    Iterator,
    Optional,
    Protocol,
    runtime_checkable,
)

logger = logging.getLogger(__name__)

LIBNUMA_NAME = "libnuma.so.1"

# <linux/mempolicy.h>
MPOL_PREFERRED = 1
MPOL_BIND = 2


@runtime_checkable
class LibNumaApi(Protocol):
    """What placement code needs from libnuma; the real binding and tests' fakes both provide it."""

    @property
    def available(self) -> bool: ...

    def max_node(self) -> int: ...

    def configured_nodes(self) -> frozenset[int]: ...

    def set_membind(self, nodes: Iterable[int]) -> None: ...

    def set_preferred(self, node: int) -> None: ...

    def migrate_pages(
        self, pid: int, from_nodes: Iterable[int], to_nodes: Iterable[int]
    ) -> int: ...


class _Bitmask(ctypes.Structure):
    _fields_ = [("size", ctypes.c_ulong), ("maskp", ctypes.POINTER(ctypes.c_ulong))]


_BitmaskPtr = ctypes.POINTER(_Bitmask)


def _oserror(call: str, err: int, detail: str = "") -> OSError:
    suffix = f" ({detail})" if detail else ""
    return OSError(err, f"libnuma {call}{suffix} failed: {os.strerror(err)}")


class LibNuma:
    """libnuma.so.1 through ctypes. Build it with :func:`load_libnuma`."""

    def __init__(self, lib: ctypes.CDLL, *, name: str = LIBNUMA_NAME) -> None:
        self._lib = lib
        self.name = name
        self._declare()

    def _declare(self) -> None:
        lib = self._lib
        signatures = {
            "numa_available": (ctypes.c_int, []),
            "numa_max_node": (ctypes.c_int, []),
            "numa_num_configured_nodes": (ctypes.c_int, []),
            "numa_allocate_nodemask": (_BitmaskPtr, []),
            "numa_bitmask_setbit": (_BitmaskPtr, [_BitmaskPtr, ctypes.c_uint]),
            "numa_bitmask_isbitset": (ctypes.c_int, [_BitmaskPtr, ctypes.c_uint]),
            "numa_bitmask_free": (None, [_BitmaskPtr]),
            "numa_migrate_pages": (
                ctypes.c_int,
                [ctypes.c_int, _BitmaskPtr, _BitmaskPtr],
            ),
            "set_mempolicy": (
                ctypes.c_long,
                [ctypes.c_int, ctypes.POINTER(ctypes.c_ulong), ctypes.c_ulong],
            ),
        }
        for symbol, (restype, argtypes) in signatures.items():
            fn = getattr(lib, symbol)
            fn.restype = restype
            fn.argtypes = argtypes

    # -- queries ---------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self._lib.numa_available() >= 0

    def max_node(self) -> int:
        return int(self._lib.numa_max_node())

    def configured_nodes(self) -> frozenset[int]:
        """Node ids present on this host (``numa_nodes_ptr``); ids may be sparse."""
        nodes_ptr = _BitmaskPtr.in_dll(self._lib, "numa_nodes_ptr")
        if not nodes_ptr:
            return frozenset(range(self.max_node() + 1))
        return frozenset(
            node
            for node in range(self.max_node() + 1)
            if self._lib.numa_bitmask_isbitset(nodes_ptr, node)
        )

    # -- actions ---------------------------------------------------------------------------

    def set_membind(self, nodes: Iterable[int]) -> None:
        """Allocate only from ``nodes`` (MPOL_BIND) for the calling thread."""
        node_set = frozenset(nodes)
        self._set_mempolicy(MPOL_BIND, node_set, "numa_set_membind")

    def set_preferred(self, node: int) -> None:
        """Allocate from ``node`` first, elsewhere when it is full (MPOL_PREFERRED), for the calling thread."""
        self._set_mempolicy(MPOL_PREFERRED, frozenset([node]), "numa_set_preferred")

    def migrate_pages(
        self, pid: int, from_nodes: Iterable[int], to_nodes: Iterable[int]
    ) -> int:
        """Move ``pid``'s pages (0 = this process) from ``from_nodes`` to ``to_nodes``; returns pages not moved."""
        with self._nodemask(from_nodes) as src, self._nodemask(to_nodes) as dst:
            result = self._lib.numa_migrate_pages(pid, src, dst)
        if result < 0:
            raise _oserror(
                "numa_migrate_pages",
                ctypes.get_errno(),
                f"pid {pid}, {_nodes_text(from_nodes)} -> {_nodes_text(to_nodes)}",
            )
        return int(result)

    # -- helpers ---------------------------------------------------------------------------

    def _set_mempolicy(self, mode: int, nodes: frozenset[int], call: str) -> None:
        with self._nodemask(nodes) as mask:
            # The kernel reads one bit fewer than maxnode; libnuma passes size + 1 for the same reason.
            result = self._lib.set_mempolicy(
                mode, mask.contents.maskp, mask.contents.size + 1
            )
        if result < 0:
            raise _oserror(call, ctypes.get_errno(), _nodes_text(nodes))

    @functools.cached_property
    def _mask_bits(self) -> int:
        mask = self._lib.numa_allocate_nodemask()
        if not mask:
            raise _oserror("numa_allocate_nodemask", errno_mod.ENOMEM)
        try:
            return int(mask.contents.size)
        finally:
            self._lib.numa_bitmask_free(mask)

    @contextlib.contextmanager
    def _nodemask(self, nodes: Iterable[int]) -> Iterator[ctypes._Pointer]:
        """A libnuma nodemask holding ``nodes``, freed on exit."""
        nodes = frozenset(nodes)
        bits = self._mask_bits
        for node in nodes:
            if node < 0 or node >= bits:
                raise OSError(
                    errno_mod.EINVAL,
                    f"libnuma nodemask: node {node} is outside 0-{bits - 1}, the nodes this kernel supports",
                )
        mask = self._lib.numa_allocate_nodemask()
        if not mask:
            raise _oserror("numa_allocate_nodemask", errno_mod.ENOMEM)
        try:
            for node in sorted(nodes):
                self._lib.numa_bitmask_setbit(mask, node)
            yield mask
        finally:
            self._lib.numa_bitmask_free(mask)


def _nodes_text(nodes: Iterable[int]) -> str:
    ordered = sorted(set(nodes))
    return "nodes " + ",".join(str(n) for n in ordered) if ordered else "no nodes"


def _open(name: str) -> Optional[LibNuma]:
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        logger.info(
            f"libnuma not loaded ({name}: {exc}); in-process NUMA memory binding is unavailable"
        )
        return None
    try:
        binding = LibNuma(lib, name=name)
    except AttributeError as exc:
        logger.info(
            f"libnuma at {name} lacks a symbol placement needs ({exc}); treating it as unavailable"
        )
        return None
    if not binding.available:
        logger.info(
            f"libnuma loaded from {name} but numa_available() < 0: the kernel reports no NUMA support"
        )
        return None
    return binding


@functools.lru_cache(maxsize=None)
def load_libnuma(*, name: str = LIBNUMA_NAME) -> Optional[LibNuma]:
    """libnuma for this process, or None (logged once) when it is missing or NUMA is unavailable.

    ``name`` is a seam: tests point it at a library that does not exist (and
    ``load_libnuma.cache_clear()`` forgets what was loaded).
    """
    return _open(name)


# <linux/mempolicy.h> modes, indexed by number.
_MODE_NAMES = {
    0: "default",
    1: "preferred",
    2: "bind",
    3: "interleave",
    4: "local",
    5: "preferred_many",
    6: "weighted_interleave",
}
# MPOL_F_STATIC_NODES | MPOL_F_RELATIVE_NODES | MPOL_F_NUMA_BALANCING ride in the high bits of the mode.
_MODE_FLAGS_MASK = (1 << 15) | (1 << 14) | (1 << 13)

# __NR_get_mempolicy; architectures not listed go through libnuma's wrapper instead.
_SYS_GET_MEMPOLICY = {
    "x86_64": 239,
    "amd64": 239,
    "aarch64": 236,
    "arm64": 236,
    "riscv64": 236,
}

# Room for 4096 node bits: more than any kernel's MAX_NUMNODES, so get_mempolicy never says EINVAL for size.
_MASK_BITS = 4096
_ULONG_BITS = ctypes.sizeof(ctypes.c_ulong) * 8


# -- get_mempolicy ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _get_mempolicy_function() -> Callable[..., int]:
    arch = platform.machine().lower()
    number = _SYS_GET_MEMPOLICY.get(arch)
    if number is not None:
        libc = ctypes.CDLL(None, use_errno=True)
        syscall = libc.syscall
        syscall.restype = ctypes.c_long

        def call(mode: Any, mask: Any, maxnode: int, addr: Any, flags: int) -> int:
            return syscall(
                ctypes.c_long(number),
                mode,
                mask,
                ctypes.c_ulong(maxnode),
                addr,
                ctypes.c_ulong(flags),
            )

        return call
    try:
        lib = ctypes.CDLL("libnuma.so.1", use_errno=True)
    except OSError as exc:
        raise OSError(
            f"cannot read the memory policy on {arch}: no get_mempolicy syscall number known and libnuma.so.1 "
            f"not loadable ({exc})"
        ) from None
    fn = lib.get_mempolicy
    fn.restype = ctypes.c_long
    return lambda mode, mask, maxnode, addr, flags: fn(
        mode, mask, ctypes.c_ulong(maxnode), addr, ctypes.c_uint(flags)
    )


def read_mempolicy() -> tuple[str, frozenset[int]]:
    """The calling thread's memory policy and its nodes, from get_mempolicy(2)."""
    call = _get_mempolicy_function()
    mode = ctypes.c_int(0)
    words = _MASK_BITS // _ULONG_BITS
    mask = (ctypes.c_ulong * words)()
    # The kernel reads one bit fewer than maxnode, as for set_mempolicy.
    result = call(ctypes.byref(mode), mask, _MASK_BITS + 1, None, 0)
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"get_mempolicy failed: {os.strerror(err)}")
    nodes = frozenset(
        word_index * _ULONG_BITS + bit
        for word_index, word in enumerate(mask)
        if word
        for bit in range(_ULONG_BITS)
        if word >> bit & 1
    )
    number = mode.value & ~_MODE_FLAGS_MASK
    name = _MODE_NAMES.get(number, f"mode{number}")
    # Older kernels report local allocation as MPOL_PREFERRED with no nodes.
    if name == "preferred" and not nodes:
        name = "local"
    return name, nodes
