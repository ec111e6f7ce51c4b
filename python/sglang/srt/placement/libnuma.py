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

    def configured_nodes(self) -> frozenset[int]:
        mask = ctypes.POINTER(_Bitmask).in_dll(self.cdll, "numa_nodes_ptr").contents
        return _nodes(mask.maskp[: -(-mask.size // _ULONG_BITS)])

    def set_membind(self, nodes: Iterable[int]) -> None:
        self._set_policy(MPOL_BIND, frozenset(nodes), "numa_set_membind")

    def set_preferred(self, node: int) -> None:
        self._set_policy(MPOL_PREFERRED, frozenset([node]), "numa_set_preferred")

    def _set_policy(self, mode: int, nodes: frozenset[int], call: str) -> None:
        _check(self.cdll.set_mempolicy(mode, _mask(nodes), _MAXNODE), call, nodes)

    def migrate_pages(self, pid: int, old: Iterable[int], new: Collection[int]) -> int:
        result = self.cdll.migrate_pages(pid, _MAXNODE, _mask(old), _mask(new))
        return _check(result, "migrate_pages", new)  # pages that stayed


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
