"""Host facts read from a sysfs root: the live /sys, a ``capture`` snapshot or a fake.
Node ids may be sparse; a node may lack CPUs or memory. A kernel without NUMA is one
node 0 whose memory is its online memory blocks, else sysconf's (the live /sys only;
a snapshot's marker carries it)."""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from typing import Optional

from sglang.srt.placement.cpulist import parse_cpulist, shown
from sglang.srt.placement.types import (
    Cpu,
    HostTopology,
    NumaNode,
    PciDevice,
    PlacementError,
    ProcessAffinity,
)

SNAPSHOT_MARKER = "sglang-placement-snapshot.json"
SNAPSHOT_FORMAT = 1
_CAPTURE = "python -m sglang.srt.placement_tools capture DIR"
LIVE_SYSFS = "/sys"
ROOT_SETTING = "SGLANG_SYSFS_ROOT"

CPU_ONLINE = "devices/system/cpu/online"
NODE_DIR = "devices/system/node"
MEMORY_DIR = "devices/system/memory"
PCI_DIR = "bus/pci/devices"
MAX_FILE_BYTES = 64 * 1024  # a sysfs attribute holds a page (4 KiB), a marker less

_PCI_ADDRESS_RE = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_INTEGER = {10: r"[+-]?[0-9]{1,20}", 16: r"[0-9a-fA-F]{1,16}"}
_KINDS = dict(p="a FIFO", c="a character device", b="a block device", d="a directory")


def read_file(path: str, *, fix: str) -> bytes:
    """A FIFO, a device or a larger file is refused unread: checked before an
    O_NONBLOCK open (so a FIFO swapped in cannot block it) and after."""
    try:
        _check_regular(os.stat(path).st_mode, path, fix)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        try:
            _check_regular(os.fstat(fd).st_mode, path, fix)
            data = b""
            while chunk := os.read(fd, MAX_FILE_BYTES + 1 - len(data)):
                data += chunk
                if len(data) > MAX_FILE_BYTES:
                    raise PlacementError(
                        f"{path}: is larger than {MAX_FILE_BYTES} bytes, far more than "
                        f"such a file holds; {fix}"
                    )
            return data
        finally:
            os.close(fd)
    except FileNotFoundError:
        problem = "missing"
    except OSError as exc:
        problem = f"cannot be read ({exc.strerror or exc})"
    raise PlacementError(f"{path}: {problem}; {fix}")


def _check_regular(mode: int, path: str, fix: str) -> None:
    if not stat.S_ISREG(mode):
        kind = _KINDS.get(stat.filemode(mode)[0], "not a regular file")
        raise PlacementError(f"{path}: is {kind}, expected a regular file; {fix}")


def read_topology(
    root: str | os.PathLike = LIVE_SYSFS, *, setting: str = ROOT_SETTING
) -> HostTopology:
    """Errors name the file, and a fix naming ``setting``, what chose ``root``."""
    return _read(root, setting=setting).topology


_cached: dict[str, tuple[tuple[bytes, ...], HostTopology]] = {}


def read_topology_cached(root: str | os.PathLike = LIVE_SYSFS) -> HostTopology:
    """Read again only when the online CPUs or nodes changed: sglang spawns its ranks
    one by one, each placed from the same facts."""
    path = os.path.abspath(os.fspath(root))
    stamp = tuple(_stamp(path, rel) for rel in (CPU_ONLINE, f"{NODE_DIR}/online"))
    hit = _cached.get(path)
    if hit is None or hit[0] != stamp:  # racing threads at worst both read the tree
        hit = _cached[path] = (stamp, read_topology(path))
    return hit[1]


def _stamp(root: str, rel: str) -> bytes:
    try:
        return read_file(os.path.join(root, rel), fix="")
    except PlacementError:
        return b""


def read_process_affinity(
    status_path: str | os.PathLike = "/proc/self/status",
) -> ProcessAffinity:
    path = os.fspath(status_path)
    fix = "pass the status file of a running process, such as /proc/self/status"
    text = read_file(path, fix=fix).decode("ascii", errors="replace")
    found = []
    for key in ("Cpus_allowed_list", "Mems_allowed_list"):
        match = re.search(rf"^{key}:(.*)$", text, re.MULTILINE)
        if match is None:
            raise PlacementError(f"{path}: has no {key} line; {fix}")
        try:
            found.append(parse_cpulist(match[1], what=f"{path} {key}"))
        except ValueError as exc:
            raise PlacementError(f"{exc}; {fix}") from None
    return ProcessAffinity(cpus=found[0], mems=found[1], source="this process")


@dataclass(frozen=True)
class TopologyRead:
    topology: HostTopology
    files: dict[str, str]  # the text of each file read, for a capture
    memory_kb_from_sysconf: Optional[int] = None


class _Reader:
    def __init__(self, root: str, setting: str) -> None:
        self.root = root
        self.files: dict[str, str] = {}
        self.snapshot = _read_marker(root)
        self.fix = _tree_fix(setting)
        if self.snapshot is not None:
            kernel, when = (
                shown(self.snapshot.get(key, "unknown"), limit=80, quote=False)
                for key in ("kernel_release", "captured_at")
            )
            self.fix = (
                f"this snapshot (captured from kernel {kernel} at {when}) is "
                f"incomplete or was edited; re-capture it with `{_CAPTURE}` on "
                "the host it describes"
            )

    def path(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def error(self, rel: str, problem: str) -> PlacementError:
        return PlacementError(f"{self.path(rel)}: {problem}; {self.fix}")

    def read(self, rel: str) -> str:
        data = read_file(self.path(rel), fix=self.fix)
        self.files[rel] = text = data.decode("ascii", errors="replace")
        return text

    def listdir(self, rel: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(rel)))
        except OSError as exc:
            raise self.error(rel, f"cannot be listed ({exc.strerror})") from None

    def cpulist(self, rel: str) -> frozenset[int]:
        text = self.read(rel)
        try:
            return parse_cpulist(text)
        except ValueError as exc:
            why = exc.__cause__ or exc
            raise self.error(
                rel, f"{shown(text.strip())} is not a CPU list such as '0-3,8' ({why})"
            ) from None

    def integer(self, rel: str, *, base: int = 10) -> int:
        text = self.read(rel).strip()
        if re.fullmatch(_INTEGER[base], text) is None:
            raise self.error(rel, f"{shown(text)} is not an integer")
        return int(text, base)


def _tree_fix(setting: str) -> str:
    how = f"pass {setting} pointing at" if setting[:2] == "--" else f"set {setting} to"
    return f"{how} a sysfs tree (the live /sys, or a snapshot made with `{_CAPTURE}`)"


def _read(root: str | os.PathLike, *, setting: str = ROOT_SETTING) -> TopologyRead:
    root = os.path.abspath(os.fspath(root))
    if not os.path.isdir(root):
        problem = "is not a directory" if os.path.exists(root) else "does not exist"
        raise PlacementError(f"{setting}={root}: {problem}; {_tree_fix(setting)}")
    reader = _Reader(root, setting)
    online = reader.cpulist(CPU_ONLINE)
    if not online:
        raise reader.error(CPU_ONLINE, "lists no online CPU")
    from_sysconf = None
    if os.path.exists(reader.path(NODE_DIR)):
        nodes = _read_nodes(reader, online)
    else:
        memory_kb, from_sysconf = _memory_without_numa(reader)
        nodes = (NumaNode(node_id=0, cpus=online, memory_kb=memory_kb),)
    node_of_cpu = {cpu: node.node_id for node in nodes for cpu in node.cpus}
    cpus = tuple(
        _read_cpu(reader, cpu, node_of_cpu.get(cpu), online) for cpu in sorted(online)
    )
    topology = HostTopology(root, nodes, cpus, online, _read_pci(reader))
    return TopologyRead(topology, reader.files, from_sysconf)


def _read_marker(root: str) -> Optional[dict]:
    path = os.path.join(root, SNAPSHOT_MARKER)
    if not os.path.lexists(path):  # a dangling link or a link loop is an error
        return None
    fix = f"re-capture the snapshot with `{_CAPTURE}`"
    data = read_file(path, fix=fix)
    try:
        marker = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # JSON and Unicode errors included
        problem = f"is not a readable snapshot marker ({shown(exc, quote=False)})"
        raise PlacementError(f"{path}: {problem}; {fix}") from None
    if not isinstance(marker, dict) or not isinstance(marker.get("format"), int):
        raise PlacementError(f"{path}: has no integer 'format' field; {fix}")
    if marker["format"] > SNAPSHOT_FORMAT:
        raise PlacementError(
            f"{path}: snapshot format {marker['format']} is newer than this version "
            f"reads ({SNAPSHOT_FORMAT}); upgrade sglang or {fix} with this version"
        )
    return marker


def _read_nodes(reader: _Reader, online: frozenset[int]) -> tuple[NumaNode, ...]:
    node_ids = []
    for name in reader.listdir(NODE_DIR):
        if re.fullmatch(r"node[0-9]+", name):
            if not os.path.isdir(reader.path(f"{NODE_DIR}/{name}")):
                raise reader.error(f"{NODE_DIR}/{name}", "is not a directory")
            node_ids.append(int(name[4:]))
    if not node_ids:
        raise reader.error(NODE_DIR, "holds no nodeN directory")
    node_ids.sort()
    nodes = []
    for node_id in node_ids:
        base = f"{NODE_DIR}/node{node_id}"
        # Some architectures keep offline CPUs in the node's list.
        cpus = reader.cpulist(f"{base}/cpulist") & online
        meminfo = reader.read(f"{base}/meminfo")
        total = re.search(
            rf"^Node\s+{node_id}\s+MemTotal:\s+([0-9]{{1,20}})\s*kB", meminfo, re.M
        )
        if total is None:
            problem = "has no 'Node N MemTotal: <size> kB' line"
            raise reader.error(f"{base}/meminfo", problem)
        words = reader.read(f"{base}/distance").split()
        row = [int(word) for word in words if re.fullmatch(_INTEGER[10], word)]
        # The kernel prints one distance per online node, in node id order.
        if len(row) != len(words) or len(row) != len(node_ids):
            raise reader.error(
                f"{base}/distance",
                f"has {len(row)} distances but there are {len(node_ids)} nodes "
                f"({', '.join(map(str, node_ids))})",
            )
        nodes.append(NumaNode(node_id, cpus, int(total[1]), tuple(zip(node_ids, row))))
    return tuple(nodes)


def _memory_without_numa(reader: _Reader) -> tuple[int, Optional[int]]:
    if os.path.exists(reader.path(MEMORY_DIR)):
        block_bytes = reader.integer(f"{MEMORY_DIR}/block_size_bytes", base=16)
        blocks = sum(
            reader.integer(f"{MEMORY_DIR}/{name}/online") == 1
            for name in reader.listdir(MEMORY_DIR)
            if re.fullmatch(r"memory[0-9]+", name)
        )
        if blocks == 0:
            raise reader.error(MEMORY_DIR, "holds no online memory block")
        return blocks * block_bytes // 1024, None
    memory_kb = (reader.snapshot or {}).get("memory_kb")
    if type(memory_kb) is int and memory_kb > 0:
        return memory_kb, memory_kb
    if reader.snapshot is None and os.path.realpath(reader.root) == LIVE_SYSFS:
        memory_kb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 1024
        return memory_kb, memory_kb
    raise reader.error(
        NODE_DIR,
        f"missing, and so is {reader.path(MEMORY_DIR)}: the tree says nothing about "
        "memory",
    )


def _read_cpu(
    reader: _Reader, cpu: int, node_id: Optional[int], online: frozenset[int]
) -> Cpu:
    base = f"devices/system/cpu/cpu{cpu}"
    l3 = f"{base}/cache/index3/shared_cpu_list"  # index3 is the L3 wherever one is
    return Cpu(
        cpu_id=cpu,
        node_id=node_id,
        package_id=reader.integer(f"{base}/topology/physical_package_id"),
        core_id=reader.integer(f"{base}/topology/core_id"),
        thread_siblings=reader.cpulist(f"{base}/topology/thread_siblings_list")
        & online,
        l3_cpus=(
            reader.cpulist(l3) & online if os.path.exists(reader.path(l3)) else None
        ),
    )


def _read_pci(reader: _Reader) -> tuple[PciDevice, ...]:
    if not os.path.exists(reader.path(PCI_DIR)):
        return ()
    devices = []
    for name in reader.listdir(PCI_DIR):
        rel = f"{PCI_DIR}/{name}"
        if not _PCI_ADDRESS_RE.fullmatch(name.lower()):
            raise reader.error(rel, "is not a PCI address such as 0000:18:00.0")
        if not os.path.isdir(reader.path(rel)):
            raise reader.error(rel, "does not lead to a device directory")
        # No numa_node (a kernel without NUMA) or -1: the kernel does not know.
        node = -1
        if os.path.exists(reader.path(f"{rel}/numa_node")):
            node = reader.integer(f"{rel}/numa_node")
        keys = ("vendor", "device", "class")
        fields = (reader.read(f"{rel}/{key}").strip().lower() for key in keys)
        devices.append(PciDevice(name.lower(), node if node >= 0 else None, *fields))
    return tuple(sorted(devices, key=lambda dev: dev.address))
