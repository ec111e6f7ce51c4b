"""libnuma.so.1 through ctypes. ``numa_set_membind`` and ``numa_set_preferred`` return
void and only print a refusal; libnuma's ``set_mempolicy`` wrapper, given the same
arguments, lets the kernel's answer reach us as an ``OSError``."""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
from typing import Iterable, Optional

logger = logging.getLogger(__name__)

MPOL_PREFERRED, MPOL_BIND = 1, 2  # <linux/mempolicy.h>
_MODE_NAMES = ("default", "preferred", "bind", "interleave", "local")
_MODE_NAMES += ("preferred_many", "weighted_interleave")
# MPOL_F_STATIC_NODES, MPOL_F_RELATIVE_NODES, MPOL_F_NUMA_BALANCING: a mode's high bits
_MODE_FLAGS = (1 << 15) | (1 << 14) | (1 << 13)
# Above any kernel's MAX_NUMNODES, so no call fails for the size of its mask.
MASK_BITS = 4096
_ULONG_BITS = ctypes.sizeof(ctypes.c_ulong) * 8
_Mask = ctypes.c_ulong * (MASK_BITS // _ULONG_BITS)
# The kernel reads one bit fewer than the maxnode it is given (libnuma passes size + 1).
_MAXNODE = ctypes.c_ulong(MASK_BITS + 1)


class _Bitmask(ctypes.Structure):
    _fields_ = [("size", ctypes.c_ulong), ("maskp", ctypes.POINTER(ctypes.c_ulong))]


def _mask(nodes: Iterable[int]) -> ctypes.Array:
    mask = _Mask()
    for node in nodes:
        if not 0 <= node < MASK_BITS:
            raise OSError(
                errno.EINVAL,
                f"libnuma nodemask: node {node} is outside 0-{MASK_BITS - 1}",
            )
        mask[node // _ULONG_BITS] |= 1 << node % _ULONG_BITS
    return mask


def _nodes(words: Iterable[int]) -> frozenset[int]:
    return frozenset(
        index * _ULONG_BITS + bit
        for index, word in enumerate(words)
        if word
        for bit in range(_ULONG_BITS)
        if word >> bit & 1
    )


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

    def migrate_pages(
        self, pid: int, from_nodes: Iterable[int], to_nodes: Iterable[int]
    ) -> int:
        src, dst = _mask(from_nodes), _mask(to_nodes)
        result = self.cdll.migrate_pages(pid, _MAXNODE, src, dst)
        return _check(result, "migrate_pages", _nodes(dst))  # pages that stayed


@functools.lru_cache(maxsize=None)
def load_libnuma(*, name: str = "libnuma.so.1") -> Optional[LibNuma]:
    """None (logged once) when it is missing or the kernel refuses NUMA calls."""
    try:
        cdll = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        logger.info(f"libnuma not loaded ({name}: {exc}): no in-process memory binding")
        return None
    if cdll.numa_available() < 0:
        logger.info(f"{name}: numa_available() < 0: the kernel refuses NUMA calls here")
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
