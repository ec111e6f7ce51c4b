"""Host facts (NUMA nodes, CPUs, PCI devices) read from a sysfs root into frozen values.

The root is normally the live ``/sys``; it can also be a snapshot made with
``python -m sglang.srt.placement_tools capture DIR`` or a fake tree in tests, which is
how a placement is planned for a host other than this one.

What is read, relative to the root:

* ``devices/system/cpu/online`` - the online CPUs; offline CPUs appear nowhere else.
* ``devices/system/cpu/cpuN/topology/{physical_package_id,core_id,thread_siblings_list}``
  for each online CPU (the kernel removes ``topology`` while a CPU is offline).
* ``devices/system/cpu/cpuN/cache/index3/shared_cpu_list`` where the kernel has it: the
  CPUs sharing an L3 (index3 is the L3 wherever there is one), for ``core-complex``
  mode. A CPU without it (a VM, a kernel without cacheinfo) has no L3 group.
* ``devices/system/node/nodeN/{cpulist,meminfo,distance}`` for each node directory.
  Node ids may be sparse, a node may have no CPUs (GPU or CXL memory) and a node may
  have no memory (``MemTotal: 0 kB``).
* ``bus/pci/devices/ADDR/{numa_node,vendor,device,class}`` (symlinks on a live host,
  plain directories in a snapshot). ``numa_node`` is -1, or absent on a kernel without
  NUMA, when the kernel does not know the device's node.

A kernel built without NUMA has no ``devices/system/node``: the host is then one node 0
holding every online CPU, with its memory taken from ``devices/system/memory`` (the
online memory blocks times ``block_size_bytes``; this counts memory the kernel reserves
for itself, so it is a little above ``MemTotal``). A kernel without memory hotplug has no
``devices/system/memory`` either; only for the live ``/sys`` is the size then taken from
``sysconf(_SC_PHYS_PAGES)`` (the ``sysinfo`` call, the same total), and a snapshot
carries that figure in its marker file. A tree that has neither is an error rather than
a guess.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import threading
from dataclasses import dataclass, field
from typing import Optional

from sglang.srt.placement.cpulist import CpuListError, parse_cpulist, shown
from sglang.srt.placement.types import (
    Cpu,
    HostTopology,
    NumaNode,
    PciDevice,
    ProcessAffinity,
    TopologyError,
)

logger = logging.getLogger(__name__)

SNAPSHOT_MARKER = "sglang-placement-snapshot.json"
SNAPSHOT_FORMAT = 1
CAPTURE_COMMAND = "python -m sglang.srt.placement_tools capture DIR"
LIVE_SYSFS = "/sys"

CPU_ONLINE = "devices/system/cpu/online"
NODE_DIR = "devices/system/node"
MEMORY_DIR = "devices/system/memory"
PCI_DIR = "bus/pci/devices"

MAX_FILE_BYTES = 64 * 1024
"""The most read from one file: a sysfs attribute holds at most a page (4 KiB), a snapshot marker far less."""

_NODE_DIR_RE = re.compile(r"^node(\d+)$", re.ASCII)
_MEMORY_BLOCK_RE = re.compile(r"^memory(\d+)$", re.ASCII)
_MEMTOTAL_RE = re.compile(
    r"^Node\s+(\d+)\s+MemTotal:\s+(\d+)\s*kB\s*$", re.MULTILINE | re.ASCII
)
_PCI_ADDRESS_RE = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_INTEGER_RE = {
    10: re.compile(r"[+-]?[0-9]{1,20}"),
    16: re.compile(r"[0-9a-fA-F]{1,16}"),
}
_FILE_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


class FileProblem(Exception):
    """Why a file cannot be read, as the text after ``PATH: `` in an error message."""


def read_regular_file(path: str, *, limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of ``path``, a regular file (after symlinks, as the live /sys has) of at most ``limit`` bytes.

    Anything else (a FIFO, a device such as /dev/zero, a directory, a larger file) raises
    :class:`FileProblem` without reading it: the file is checked before it is opened, opened with
    ``O_NONBLOCK`` (so a FIFO swapped in meanwhile cannot block the open) and checked again.
    Sysfs attributes are regular files, so the live /sys reads as before.
    """
    try:
        _check_regular(os.stat(path).st_mode)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileProblem("missing") from None
    except (OSError, ValueError) as exc:
        raise FileProblem(
            f"cannot be read ({getattr(exc, 'strerror', None) or exc})"
        ) from None
    try:
        _check_regular(os.fstat(fd).st_mode)
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, limit + 1 - size):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise FileProblem(
                    f"is larger than {limit} bytes, far more than such a file holds"
                )
        return b"".join(chunks)
    except OSError as exc:
        raise FileProblem(f"cannot be read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)


def _check_regular(mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = _FILE_KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise FileProblem(f"is {kind}, expected a regular file")


ROOT_SETTING = "SGLANG_SYSFS_ROOT"
"""What chooses the tree outside the CLI; errors name it, since sglang's server has no --sysfs-root."""


def read_topology(
    root: str | os.PathLike = LIVE_SYSFS, *, setting: str = ROOT_SETTING
) -> HostTopology:
    """Read the NUMA nodes, online CPUs and PCI devices under ``root`` (a sysfs tree).

    Raises TopologyError, naming the file, what is wrong with it and how to fix it, when
    the tree is incomplete or holds values that do not parse. ``setting`` is what chose
    ``root`` (``SGLANG_SYSFS_ROOT``, or the CLI's ``--sysfs-root``), named in the fix.
    """
    return _read(root, setting=setting).topology


_cache_lock = threading.Lock()
_cached: dict[str, tuple[tuple[bytes, ...], HostTopology]] = {}
_CACHE_KEYS = (CPU_ONLINE, "devices/system/node/online")


def read_topology_cached(root: str | os.PathLike = LIVE_SYSFS) -> HostTopology:
    """``read_topology(root)``, read again only when the online CPUs or nodes under ``root`` changed.

    sglang spawns its ranks one after another; each is placed from the same
    host facts, so the tree is walked once per launch, not once per rank.
    """
    path = os.path.abspath(os.fspath(root))
    stamp = tuple(_stamp(os.path.join(path, rel)) for rel in _CACHE_KEYS)
    with _cache_lock:
        hit = _cached.get(path)
        if hit is not None and hit[0] == stamp:
            return hit[1]
    topology = read_topology(path)
    with _cache_lock:
        _cached[path] = (stamp, topology)
    return topology


def _stamp(path: str) -> bytes:
    try:
        return read_regular_file(path)
    except (FileProblem, OSError):
        return b""


def read_process_affinity(
    status_path: str | os.PathLike = "/proc/self/status",
    *,
    source: str = "this process",
) -> ProcessAffinity:
    """The CPUs and memory nodes a process may use, from ``Cpus_allowed_list``/``Mems_allowed_list``.

    These reflect the process's cpuset and any outer ``numactl``/``taskset``.
    """
    path = os.fspath(status_path)
    try:
        text = read_regular_file(path).decode("ascii", errors="replace")
    except FileProblem as exc:
        raise TopologyError(
            f"{path}: {exc}; pass the status file of a running process, such as /proc/self/status"
        ) from None
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            values[key.strip()] = value.strip()
    parsed: dict[str, frozenset[int]] = {}
    for key in ("Cpus_allowed_list", "Mems_allowed_list"):
        if key not in values:
            raise TopologyError(
                f"{path}: has no {key} line; pass the status file of a running process, "
                f"such as /proc/self/status"
            )
        try:
            parsed[key] = parse_cpulist(values[key], what=f"{path} {key}")
        except CpuListError as exc:
            raise TopologyError(
                f"{exc}; pass the status file of a running process"
            ) from None
    return ProcessAffinity(
        cpus=parsed["Cpus_allowed_list"],
        mems=parsed["Mems_allowed_list"],
        source=source,
    )


@dataclass(frozen=True)
class TopologyRead:
    """A topology and the exact sysfs files it came from, so that a capture copies just those."""

    topology: HostTopology
    files: dict[str, str]
    """Path relative to the root -> the text read from it."""
    memory_kb_from_sysconf: Optional[int] = None
    """Set when a kernel without NUMA or memory blocks gave the memory size only through sysconf."""


@dataclass
class _Reader:
    """Reads text files below one root, remembering each for a capture; every failure names its file."""

    root: str
    setting: str = ROOT_SETTING
    snapshot: Optional[dict] = None
    files: dict[str, str] = field(default_factory=dict)

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def fix(self) -> str:
        if self.snapshot is not None:
            kernel = shown(
                self.snapshot.get("kernel_release", "an unknown kernel"),
                limit=80,
                quote=False,
            )
            when = shown(
                self.snapshot.get("captured_at", "an unknown time"),
                limit=80,
                quote=False,
            )
            return (
                f"this snapshot (captured from kernel {kernel} at {when}) is incomplete or was edited; "
                f"re-capture it with `{CAPTURE_COMMAND}` on the host it describes"
            )
        if os.path.realpath(self.root) == LIVE_SYSFS:
            return f"this kernel's sysfs lacks it; {_point(self.setting)} a sysfs tree captured with `{CAPTURE_COMMAND}`"
        return f"{_point(self.setting)} a sysfs tree (the live /sys, or a snapshot made with `{CAPTURE_COMMAND}`)"

    def error(self, rel: str, problem: str) -> TopologyError:
        return TopologyError(f"{self.path(rel)}: {problem}; {self.fix()}")

    def exists(self, rel: str) -> bool:
        return os.path.exists(self.path(rel))

    def is_dir(self, rel: str) -> bool:
        return os.path.isdir(self.path(rel))

    def read(self, rel: str) -> str:
        try:
            text = read_regular_file(self.path(rel)).decode("ascii", errors="replace")
        except FileProblem as exc:
            raise self.error(rel, str(exc)) from None
        self.files[rel] = text
        return text

    def listdir(self, rel: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(rel)))
        except NotADirectoryError:
            raise self.error(rel, "is not a directory") from None
        except OSError as exc:
            raise self.error(rel, f"cannot be listed ({exc.strerror})") from None

    def cpulist(self, rel: str) -> frozenset[int]:
        text = self.read(rel)
        try:
            return parse_cpulist(text, what="cpulist")
        except CpuListError as exc:
            raise self.error(
                rel,
                f"{shown(text.strip())} is not a CPU list such as '0-3,8' ({exc.reason})",
            ) from None

    def integer(self, rel: str, *, base: int = 10) -> int:
        text = self.read(rel).strip()
        if _INTEGER_RE[base].fullmatch(text) is None:
            raise self.error(rel, f"{shown(text)} is not an integer")
        return int(text, base)


def _point(setting: str) -> str:
    return (
        f"pass {setting} pointing at"
        if setting.startswith("--")
        else f"set {setting} to"
    )


def _read(root: str | os.PathLike, *, setting: str = ROOT_SETTING) -> TopologyRead:
    root_text = os.path.abspath(os.fspath(root))
    if not os.path.isdir(root_text):
        problem = (
            "is not a directory" if os.path.exists(root_text) else "does not exist"
        )
        raise TopologyError(
            f"{setting}={root_text}: {problem}; {_point(setting)} a sysfs tree (the live /sys, "
            f"or a snapshot made with `{CAPTURE_COMMAND}`)"
        )
    reader = _Reader(root=root_text, setting=setting)
    reader.snapshot = _read_marker(root_text)

    online = reader.cpulist(CPU_ONLINE)
    if not online:
        raise reader.error(CPU_ONLINE, "lists no online CPU")

    memory_from_sysconf: Optional[int] = None
    if reader.exists(NODE_DIR):
        nodes = _read_nodes(reader, online)
    else:
        memory_kb, memory_from_sysconf = _memory_without_numa(reader)
        nodes = (NumaNode(node_id=0, cpus=online, memory_kb=memory_kb, distances=()),)

    node_of_cpu = {cpu: node.node_id for node in nodes for cpu in node.cpus}
    cpus = tuple(
        _read_cpu(reader, cpu, node_of_cpu.get(cpu), online) for cpu in sorted(online)
    )
    pci = _read_pci(reader)
    topology = HostTopology(
        root=root_text, nodes=nodes, cpus=cpus, online_cpus=online, pci_devices=pci
    )
    return TopologyRead(
        topology=topology,
        files=dict(reader.files),
        memory_kb_from_sysconf=memory_from_sysconf,
    )


def _read_marker(root: str) -> Optional[dict]:
    path = os.path.join(root, SNAPSHOT_MARKER)
    if not os.path.lexists(
        path
    ):  # a marker that is a dangling link or a link loop is an error, not absent
        return None
    fix = f"re-capture the snapshot with `{CAPTURE_COMMAND}`"
    try:
        marker = json.loads(read_regular_file(path).decode("utf-8"))
    except FileProblem as exc:
        raise TopologyError(f"{path}: {exc}; {fix}") from None
    except (
        ValueError,
        RecursionError,
    ) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise TopologyError(
            f"{path}: is not a readable snapshot marker ({shown(exc, quote=False)}); {fix}"
        ) from None
    if not isinstance(marker, dict) or not isinstance(marker.get("format"), int):
        raise TopologyError(f"{path}: has no integer 'format' field; {fix}")
    if marker["format"] > SNAPSHOT_FORMAT:
        raise TopologyError(
            f"{path}: snapshot format {marker['format']} is newer than this version reads "
            f"({SNAPSHOT_FORMAT}); upgrade sglang or {fix} with this version"
        )
    return marker


def _read_nodes(reader: _Reader, online: frozenset[int]) -> tuple[NumaNode, ...]:
    node_ids: list[int] = []
    for name in reader.listdir(NODE_DIR):
        match = _NODE_DIR_RE.match(name)
        if match is None:
            continue
        rel = f"{NODE_DIR}/{name}"
        if not reader.is_dir(rel):
            raise reader.error(
                rel,
                "is not a directory; a NUMA node is a directory holding cpulist, meminfo and distance",
            )
        node_ids.append(int(match.group(1)))
    if not node_ids:
        raise reader.error(NODE_DIR, "holds no nodeN directory")
    node_ids.sort()

    nodes = []
    for node_id in node_ids:
        base = f"{NODE_DIR}/node{node_id}"
        # Some architectures keep offline CPUs in the node's list; only online ones can run anything.
        cpus = reader.cpulist(f"{base}/cpulist") & online
        meminfo = reader.read(f"{base}/meminfo")
        match = _MEMTOTAL_RE.search(meminfo)
        if match is None:
            raise reader.error(
                f"{base}/meminfo", "has no 'Node N MemTotal: <size> kB' line"
            )
        if int(match.group(1)) != node_id:
            raise reader.error(
                f"{base}/meminfo",
                f"describes node {match.group(1)}, not node {node_id}",
            )
        row_text = reader.read(f"{base}/distance")
        words = row_text.split()
        if not all(_INTEGER_RE[10].fullmatch(word) for word in words):
            raise reader.error(
                f"{base}/distance",
                f"{shown(row_text.strip())} is not a row of integers",
            )
        row = [int(word) for word in words]
        # The kernel prints one distance per online node, in node id order.
        if len(row) != len(node_ids):
            raise reader.error(
                f"{base}/distance",
                f"has {len(row)} distances but there are {len(node_ids)} nodes ({', '.join(map(str, node_ids))})",
            )
        nodes.append(
            NumaNode(
                node_id=node_id,
                cpus=cpus,
                memory_kb=int(match.group(2)),
                distances=tuple(zip(node_ids, row)),
            )
        )
    return tuple(nodes)


def _memory_without_numa(reader: _Reader) -> tuple[int, Optional[int]]:
    if reader.exists(MEMORY_DIR):
        block_bytes = reader.integer(f"{MEMORY_DIR}/block_size_bytes", base=16)
        blocks = 0
        for name in reader.listdir(MEMORY_DIR):
            if _MEMORY_BLOCK_RE.match(name) is None:
                continue
            if reader.integer(f"{MEMORY_DIR}/{name}/online") == 1:
                blocks += 1
        if blocks == 0:
            raise reader.error(MEMORY_DIR, "holds no online memory block")
        return blocks * block_bytes // 1024, None
    memory_kb = (
        reader.snapshot.get("memory_kb") if reader.snapshot is not None else None
    )
    if isinstance(memory_kb, int) and not isinstance(memory_kb, bool) and memory_kb > 0:
        return memory_kb, memory_kb
    if reader.snapshot is None and os.path.realpath(reader.root) == LIVE_SYSFS:
        memory_kb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 1024
        return memory_kb, memory_kb
    raise reader.error(
        NODE_DIR,
        f"missing, and so is {reader.path(MEMORY_DIR)}: the tree says nothing about memory",
    )


def _read_cpu(
    reader: _Reader, cpu: int, node_id: Optional[int], online: frozenset[int]
) -> Cpu:
    base = f"devices/system/cpu/cpu{cpu}/topology"
    package_id = reader.integer(f"{base}/physical_package_id")
    core_id = reader.integer(f"{base}/core_id")
    siblings = reader.cpulist(f"{base}/thread_siblings_list") & online
    l3 = f"devices/system/cpu/cpu{cpu}/cache/index3/shared_cpu_list"
    l3_cpus = reader.cpulist(l3) & online if reader.exists(l3) else None
    return Cpu(
        cpu_id=cpu,
        node_id=node_id,
        package_id=package_id,
        core_id=core_id,
        thread_siblings=siblings,
        l3_cpus=l3_cpus,
    )


def _read_pci(reader: _Reader) -> tuple[PciDevice, ...]:
    if not reader.exists(PCI_DIR):
        return ()
    devices = []
    for name in reader.listdir(PCI_DIR):
        address = name.lower()
        rel = f"{PCI_DIR}/{name}"
        if not _PCI_ADDRESS_RE.match(address):
            raise reader.error(rel, "is not a PCI address such as 0000:18:00.0")
        if not reader.is_dir(rel):
            raise reader.error(
                rel, "does not lead to a device directory (a dangling link?)"
            )
        numa_node: Optional[int] = None
        if reader.exists(f"{rel}/numa_node"):
            value = reader.integer(f"{rel}/numa_node")
            numa_node = value if value >= 0 else None
        devices.append(
            PciDevice(
                address=address,
                numa_node=numa_node,
                vendor=reader.read(f"{rel}/vendor").strip().lower(),
                device=reader.read(f"{rel}/device").strip().lower(),
                pci_class=reader.read(f"{rel}/class").strip().lower(),
            )
        )
    return tuple(sorted(devices, key=lambda dev: dev.address))
