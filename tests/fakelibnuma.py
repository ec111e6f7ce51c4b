"""A stand-in for libnuma with the kernel's answers, for NUMA shapes this host does not have.

It keeps the memory policy and page counts in Python and records every call;
it never touches the real process. Where the real library would fail, it fails
the same way (``OSError`` with the errno the kernel returns):

* a memory policy (bind or preferred) naming no node with memory -> EINVAL, as the
  kernel intersects the mask with the nodes that have memory and rejects an empty result;
* ``move_private_pages`` to a node that is not a memory node -> EINVAL;
* ``fail={"set_membind": errno.EPERM}`` makes one call fail like a kernel or seccomp
  profile that refuses it.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional


@dataclass
class FakeLibNuma:
    node_cpus: Mapping[int, Iterable[int]] = field(
        default_factory=lambda: {0: (0,), 1: (1,)}
    )
    """CPUs of each node; node ids may be sparse."""
    memory_nodes: Optional[Iterable[int]] = None
    """Nodes with memory; None means every node has memory."""
    fail: Mapping[str, int] = field(default_factory=dict)
    """Method name -> errno that call fails with."""
    pages: dict[int, int] = field(default_factory=dict)
    """Resident pages per node, moved by move_private_pages."""
    unmovable_pages: int = 0
    """Pages move_private_pages leaves behind (one mapping each, as pages the kernel cannot move)."""

    calls: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)
    policy: str = "default"
    policy_nodes: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        self.node_cpus = {int(n): frozenset(cpus) for n, cpus in self.node_cpus.items()}
        self.memory_nodes = (
            frozenset(self.node_cpus)
            if self.memory_nodes is None
            else frozenset(self.memory_nodes)
        )

    # -- what placement calls on libnuma.LibNuma ---------------------------------------------

    def set_membind(self, nodes: Iterable[int]) -> None:
        node_set = frozenset(nodes)
        self._call("set_membind", node_set)
        self.policy_nodes = self._memory_mask("numa_set_membind", node_set)
        self.policy = "bind"

    def set_preferred(self, node: int) -> None:
        self._call("set_preferred", node)
        self.policy_nodes = self._memory_mask("numa_set_preferred", frozenset([node]))
        self.policy = "preferred"

    def move_private_pages(self, policy: int, nodes: Iterable[int]) -> int:
        """The real one mbinds each private anonymous mapping with MPOL_MF_MOVE: here every
        page moves to the first of ``nodes``, but ``unmovable_pages`` (one mapping each).
        """
        dst = frozenset(nodes)
        self._call("move_private_pages", policy, dst)
        if not dst or not dst <= self.memory_nodes:
            raise self._error("mbind", errno.EINVAL)
        target = min(dst)
        moving = sum(pages for node, pages in self.pages.items() if node not in dst)
        stuck = min(self.unmovable_pages, moving)
        for node in [n for n in self.pages if n not in dst]:
            self.pages[node] = 0
        self.pages[target] = self.pages.get(target, 0) + moving - stuck
        if stuck:
            first = min(n for n in self.pages if n not in dst)
            self.pages[first] = stuck
        return stuck

    # -- helpers ------------------------------------------------------------------------------

    def called(self, name: str) -> list[tuple[Any, ...]]:
        return [args for call, args in self.calls if call == name]

    def _call(self, name: str, *args: Any) -> None:
        self.calls.append((name, args))
        if name in self.fail:
            raise self._error(name, self.fail[name])

    def _memory_mask(self, call: str, nodes: frozenset[int]) -> frozenset[int]:
        effective = nodes & self.memory_nodes
        if not effective:
            raise self._error(call, errno.EINVAL)
        return effective

    @staticmethod
    def _error(call: str, err: int) -> OSError:
        return OSError(err, f"libnuma {call} failed: {os.strerror(err)}")
