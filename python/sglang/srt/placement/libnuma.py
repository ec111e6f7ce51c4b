"""libnuma.so.1 through ctypes. ``numa_set_membind`` and ``numa_set_preferred`` return
void and only print a refusal; libnuma's ``set_mempolicy`` wrapper, given the same
arguments, lets the kernel's answer reach us as an ``OSError``."""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
from typing import Collection, Iterable, Optional

logger = logging.getLogger(__name__)

LIBRARY = "libnuma.so.1"
MPOL_PREFERRED, MPOL_BIND = 1, 2  # <linux/mempolicy.h>
MPOL_MF_MOVE = 1 << 1  # move the pages only this process maps, never shared ones
MAPS = "/proc/self/maps"
_KERNEL_AREAS = ("[vvar]", "[vvar_vclock]", "[vdso]", "[vsyscall]")
_MODE_NAMES = ("default", "preferred", "bind", "interleave", "local")
_MODE_NAMES += ("preferred_many", "weighted_interleave")
_MODE_FLAGS = 7 << 13  # MPOL_F_STATIC_NODES, _RELATIVE_NODES, _NUMA_BALANCING
MASK_BITS = 4096  # above any kernel's MAX_NUMNODES: no call fails for its mask's size
_ULONG_BITS = ctypes.sizeof(ctypes.c_ulong) * 8
_Mask = ctypes.c_ulong * (MASK_BITS // _ULONG_BITS)
_MAXNODE = ctypes.c_ulong(MASK_BITS + 1)  # the kernel reads maxnode - 1 bits


class _Bitmask(ctypes.Structure):
    _fields_ = [("size", ctypes.c_ulong), ("maskp", ctypes.POINTER(ctypes.c_ulong))]


def _mask(nodes: Iterable[int]) -> ctypes.Array:
    mask = _Mask()
    for node in nodes:
        if not 0 <= node < MASK_BITS:
            why = f"libnuma nodemask: node {node} is outside 0-{MASK_BITS - 1}"
            raise OSError(errno.EINVAL, why)
        mask[node // _ULONG_BITS] |= 1 << node % _ULONG_BITS
    return mask


def _nodes(words: Iterable[int]) -> frozenset[int]:
    bits = "".join(format(word, f"0{_ULONG_BITS}b")[::-1] for word in words)
    return frozenset(node for node, bit in enumerate(bits) if bit == "1")


def _check(result: int, call: str, nodes: Iterable[int]) -> int:
    if result < 0:
        err = ctypes.get_errno()
        text = ",".join(map(str, sorted(nodes))) or "none"
        raise OSError(err, f"libnuma {call} (nodes {text}) failed: {os.strerror(err)}")
    return result


class LibNuma:
    def __init__(self, cdll: ctypes.CDLL) -> None:
        self.cdll = cdll

    def set_membind(self, nodes: Iterable[int]) -> None:
        self._set_policy(MPOL_BIND, frozenset(nodes), "numa_set_membind")

    def set_preferred(self, node: int) -> None:
        self._set_policy(MPOL_PREFERRED, frozenset([node]), "numa_set_preferred")

    def _set_policy(self, mode: int, nodes: frozenset[int], call: str) -> None:
        _check(self.cdll.set_mempolicy(mode, _mask(nodes), _MAXNODE), call, nodes)

    def move_private_pages(self, policy: int, nodes: Collection[int]) -> int:
        """Moves the pages of this process's private anonymous mappings (heap, stack,
        malloc and torch arenas) to ``nodes`` under ``policy`` (MPOL_BIND or
        MPOL_PREFERRED); shared and file-backed pages stay. Returns how many mappings
        refused (one that vanished meanwhile, or pages the kernel could not move)."""
        refused = 0
        mask = _mask(nodes)
        for start, end in private_mappings():
            length = ctypes.c_ulong(end - start)
            address = ctypes.c_void_p(start)
            flags = ctypes.c_uint(MPOL_MF_MOVE)
            if self.cdll.mbind(address, length, policy, mask, _MAXNODE, flags) < 0:
                refused += 1
        return refused


@functools.cache
def load_libnuma() -> Optional[LibNuma]:
    """None (logged once) when it is missing or the kernel refuses NUMA calls."""
    try:
        cdll = ctypes.CDLL(LIBRARY, use_errno=True)
    except OSError as exc:
        logger.info(f"{LIBRARY} not loaded ({exc}): no in-process memory binding")
        return None
    if cdll.numa_available() < 0:
        logger.info(f"{LIBRARY}: numa_available() < 0: the kernel refuses NUMA calls")
        return None
    return LibNuma(cdll)


def private_mappings(maps: str = MAPS) -> list[tuple[int, int]]:
    """(start, end) of each private anonymous mapping of ``maps``."""
    found = []
    with open(maps) as f:
        for line in f:
            fields = line.split(maxsplit=5)
            path = fields[5].strip() if len(fields) > 5 else ""
            private = fields[1][3] == "p" and fields[4] == "0"
            if private and path not in _KERNEL_AREAS and not path.startswith("/"):
                start, end = (int(part, 16) for part in fields[0].split("-"))
                found.append((start, end))
    return found


def read_mempolicy() -> tuple[str, frozenset[int]]:
    lib = load_libnuma()
    if lib is None:
        raise OSError(errno.ENOSYS, "get_mempolicy: libnuma or NUMA is unavailable")
    mode, mask = ctypes.c_int(0), _Mask()
    call = lib.cdll.get_mempolicy(ctypes.byref(mode), mask, _MAXNODE, None, 0)
    _check(call, "get_mempolicy", ())
    number, nodes = mode.value & ~_MODE_FLAGS, _nodes(mask)
    name = _MODE_NAMES[number] if number < len(_MODE_NAMES) else f"mode{number}"
    # Older kernels report local allocation as MPOL_PREFERRED with no nodes.
    return ("local" if name == "preferred" and not nodes else name), nodes
