"""Host facts read from a sysfs root: the live /sys, a ``capture`` snapshot or a fake.
Node ids may be sparse; a node may lack CPUs or memory. A kernel without NUMA is one
node 0 with all the host's CPUs and memory."""

from __future__ import annotations

import json
import os
import re
import stat
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

#: Where the live host's sysfs is; tests point it at a fake tree (monkeypatch).
SYSFS_ROOT = "/sys"
SNAPSHOT_MARKER = "sglang-placement-snapshot.json"
SNAPSHOT_FORMAT = 1
_TREE = "a sysfs tree (the live /sys, or a snapshot of one)"
CPU_ONLINE = "devices/system/cpu/online"
NODE_DIR = "devices/system/node"
PCI_DIR = "bus/pci/devices"
MAX_FILE_BYTES = 64 * 1024  # a sysfs attribute holds a page (4 KiB), a marker less
_PCI_ADDRESS_RE = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_INTEGER = r"[+-]?[0-9]{1,20}"
_PCI_FIELDS = ("vendor", "device", "class")
_KINDS = dict(p="a FIFO", c="a character device", b="a block device", d="a directory")


def read_file(path: str, *, fix: str) -> bytes:
    """A FIFO, a device or a larger file is refused unread: checked before an
    O_NONBLOCK open (so a FIFO swapped in cannot block it) and after."""
    try:
        _check_regular(os.stat(path).st_mode, path, fix)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        with open(fd, "rb") as file:
            _check_regular(os.fstat(fd).st_mode, path, fix)
            data = file.read(MAX_FILE_BYTES + 1)
        if len(data) <= MAX_FILE_BYTES:
            return data
        problem = f"is larger than {MAX_FILE_BYTES} bytes, more than such a file holds"
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
    root: str | os.PathLike, *, setting: Optional[str] = None
) -> HostTopology:
    """Errors name the file, and a fix naming ``setting`` (a flag), what chose
    ``root``; None: the live host's."""
    return _read(root, setting=setting).topology


_cached: dict[str, tuple[list[bytes], HostTopology]] = {}


def read_topology_cached() -> HostTopology:
    """The live host's (``SYSFS_ROOT``), read again only when the online CPUs or nodes
    changed: sglang spawns its ranks one by one, each placed from the same facts."""
    path = os.path.abspath(SYSFS_ROOT)
    stamp = []
    for rel in (CPU_ONLINE, f"{NODE_DIR}/online"):
        try:
            stamp.append(read_file(os.path.join(path, rel), fix=""))
        except PlacementError:
            stamp.append(b"")
    hit = _cached.get(path)
    if hit is None or hit[0] != stamp:  # racing threads at worst both read the tree
        hit = _cached[path] = (stamp, read_topology(path))
    return hit[1]


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


class _Reader:
    """One reading of a tree: the topology, and what a capture copies and marks."""

    def __init__(self, root: str, setting: Optional[str]) -> None:
        self.root = root
        self.files: dict[str, str] = {}
        self.snapshot = _read_marker(root)
        self.fix = _fix(setting, self.snapshot)
        self.online = online = self.cpulist(CPU_ONLINE)
        if not online:
            raise self.error(CPU_ONLINE, "lists no online CPU")
        nodes = self.nodes()
        node_of_cpu = {cpu: node.node_id for node in nodes for cpu in node.cpus}
        cpus = tuple(self.cpu(cpu, node_of_cpu.get(cpu)) for cpu in sorted(online))
        self.topology = HostTopology(root, nodes, cpus, online, self.pci_devices())

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
            why = f"is not a CPU list such as '0-3,8' ({exc.__cause__ or exc})"
            raise self.error(rel, f"{shown(text.strip())} {why}") from None

    def integer(self, rel: str) -> int:
        text = self.read(rel).strip()
        if re.fullmatch(_INTEGER, text) is None:
            raise self.error(rel, f"{shown(text)} is not an integer")
        return int(text)

    def nodes(self) -> tuple[NumaNode, ...]:
        if not os.path.exists(self.path(NODE_DIR)):  # a kernel without NUMA
            return (NumaNode(0, self.online, memory_kb=None),)
        names = [n for n in self.listdir(NODE_DIR) if re.fullmatch(r"node[0-9]+", n)]
        ids = sorted(int(name[4:]) for name in names)
        if not ids:
            raise self.error(NODE_DIR, "holds no nodeN directory")
        nodes = []
        for node_id in ids:
            base = f"{NODE_DIR}/node{node_id}"
            if not os.path.isdir(self.path(base)):
                raise self.error(base, "is not a directory")
            # Some architectures keep offline CPUs in the node's list.
            cpus = self.cpulist(f"{base}/cpulist") & self.online
            pattern = rf"^Node\s+{node_id}\s+MemTotal:\s+([0-9]{{1,20}})\s*kB"
            total = re.search(pattern, self.read(f"{base}/meminfo"), re.M)
            if total is None:
                problem = "has no 'Node N MemTotal: <size> kB' line"
                raise self.error(f"{base}/meminfo", problem)
            nodes.append(NumaNode(node_id, cpus, int(total[1])))
        return tuple(nodes)

    def cpu(self, cpu: int, node_id: Optional[int]) -> Cpu:
        topology = f"devices/system/cpu/cpu{cpu}/topology"
        package = self.integer(f"{topology}/physical_package_id")
        core = self.integer(f"{topology}/core_id")
        siblings = self.cpulist(f"{topology}/thread_siblings_list") & self.online
        return Cpu(cpu, node_id, package, core, siblings)

    def pci_devices(self) -> tuple[PciDevice, ...]:
        if not os.path.exists(self.path(PCI_DIR)):
            return ()
        devices = []
        for name in self.listdir(PCI_DIR):
            rel = f"{PCI_DIR}/{name}"
            if not _PCI_ADDRESS_RE.fullmatch(name.lower()):
                raise self.error(rel, "is not a PCI address such as 0000:18:00.0")
            if not os.path.isdir(self.path(rel)):
                raise self.error(rel, "does not lead to a device directory")
            # No numa_node (a kernel without NUMA) or -1: the kernel does not know.
            has_node = os.path.exists(self.path(f"{rel}/numa_node"))
            numa = self.integer(f"{rel}/numa_node") if has_node else -1
            fields = (self.read(f"{rel}/{key}").strip().lower() for key in _PCI_FIELDS)
            devices.append(PciDevice(name.lower(), None if numa < 0 else numa, *fields))
        return tuple(sorted(devices, key=lambda dev: dev.address))


def _fix(setting: Optional[str], snapshot: Optional[dict]) -> str:
    if snapshot is None and setting is None:
        return "placement reads this host's NUMA topology there: is sysfs mounted?"
    if snapshot is None:
        return f"pass {setting} pointing at {_TREE}"
    kernel, when = (
        shown(snapshot.get(key, "unknown"), limit=80, quote=False)
        for key in ("kernel_release", "captured_at")
    )
    return (
        f"this snapshot (captured from kernel {kernel} at {when}) is incomplete or "
        "was edited; re-capture it on the host it describes"
    )


def _read(root: str | os.PathLike, *, setting: Optional[str]) -> _Reader:
    root = os.path.abspath(os.fspath(root))
    if not os.path.isdir(root):
        problem = "is not a directory" if os.path.exists(root) else "does not exist"
        given = f"{setting}={root}" if setting else root
        raise PlacementError(f"{given}: {problem}; {_fix(setting, None)}")
    return _Reader(root, setting)


def _read_marker(root: str) -> Optional[dict]:
    path = os.path.join(root, SNAPSHOT_MARKER)
    if not os.path.lexists(path):  # a dangling link or a link loop is an error
        return None
    fix = "re-capture the snapshot on the host it describes"
    try:
        marker = json.loads(read_file(path, fix=fix).decode("utf-8"))
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
