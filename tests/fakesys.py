"""Fake sysfs trees with the real Linux layout, for host shapes this machine does not have.

Two ways to say what to build, one function to build it:

* ``Shape``: the regular case, sockets x NUMA nodes per socket x cores per node x
  threads per core, optionally with GPUs on each node.
* ``Host``: the explicit form for odd shapes: node id -> ``NodeSpec(cpus, memory_kb)``,
  a list of ``PciSpec`` (``numa_node=-1`` for a device whose node the kernel does not
  know), offline CPUs, and optional per-CPU (package, core) ids and distances.

``write_sysfs(root, Shape(...) or Host(...))`` writes the tree and returns ``root``.
The ready-made shapes below (``one_node``, ``two_sockets_four_gpus``, ...) call it.

What is written mirrors a live x86 kernel: ``devices/system/cpu/{online,possible,present}``,
``cpuN/online`` (absent for cpu0), ``cpuN/topology/*`` only for online CPUs, siblings
lists holding only online CPUs, ``devices/system/node/{online,possible,has_cpu,has_memory,
has_normal_memory}``, ``nodeN/{cpulist,cpumap,meminfo,distance}`` (offline CPUs left out
of the node's lists, as x86 does), ``cpuN/cache/index0-3`` (L1d, L1i, L2 per core, L3
per group) for online CPUs when L3 groups are given (``Shape.l3_per_node``,
``Host.l3_groups``; no ``cache`` otherwise, as in a VM), and ``bus/pci/devices/ADDR`` as
symlinks into ``devices/pciDDDD:BB/ADDR`` (``PciSpec.missing`` leaves files out, and
``PciSpec.vanished`` leaves only the link). With ``Host(numa=False)`` the tree is that of a kernel built
without NUMA: no ``devices/system/node``, no PCI ``numa_node``, and memory described by
``devices/system/memory`` blocks of 128 MiB.

Shape numbering follows Linux on x86: the first thread of every core comes first, so with
C cores in all, CPU ``c`` and CPU ``c + C`` are SMT siblings. ``core_id`` counts cores within
a package. Every Shape also has a host bridge at ``0000:00:00.0`` on node 0 (class
0x060000), as real hosts do, so code must pick GPUs by vendor/class, not take every device.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence, Union


def format_cpulist(ids: Iterable[int]) -> str:
    """``0-3,8`` for {0, 1, 2, 3, 8}, as sysfs writes lists of CPUs and nodes."""
    ids, spans = sorted(set(ids)), []
    for i in ids:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


GIB_KB = 1024 * 1024
"""One GiB in kB, the unit of ``memory_kb``."""
NVIDIA_VENDOR = "0x10de"
H100_DEVICE = "0x2330"
GPU_CLASS = "0x030200"
"""3D controller: how data-centre NVIDIA GPUs show up."""
HOST_BRIDGE_CLASS = "0x060000"
MEMORY_BLOCK_KB = 128 * 1024
"""Memory block size (128 MiB) used for trees of kernels without NUMA."""


@dataclass(frozen=True)
class NodeSpec:
    cpus: frozenset[int] = frozenset()
    """All present CPUs of the node, online or not; empty for a memory-only node."""
    memory_kb: int = 32 * GIB_KB
    """MemTotal of the node; 0 for a node without memory."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "cpus", frozenset(self.cpus))


@dataclass(frozen=True)
class PciSpec:
    address: str
    """``dddd:bb:dd.f``, written as given (lower-case on real hosts)."""
    numa_node: int
    """-1 when the kernel does not know the device's node."""
    vendor: str = NVIDIA_VENDOR
    device: str = H100_DEVICE
    pci_class: str = GPU_CLASS
    missing: frozenset[str] = frozenset()
    """Files of the device left unwritten: ``{"class"}`` for a device that sysfs shows
    without one, ``{"numa_node"}`` for one whose node cannot be read."""
    vanished: bool = False
    """Its ``bus/pci/devices`` entry links to a device directory that is gone, as when
    the device is unplugged while something walks the bus."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "missing", frozenset(self.missing))


@dataclass(frozen=True)
class Host:
    """An explicit host: any node ids, CPUs, memory, PCI devices and offline CPUs."""

    nodes: Mapping[int, NodeSpec]
    pci: Sequence[PciSpec] = ()
    offline_cpus: frozenset[int] = frozenset()
    cores: Mapping[int, tuple[int, int]] = field(default_factory=dict)
    """CPU -> (physical_package_id, core_id). Default: package = the CPU's node id, core = the
    CPU id (no SMT). CPUs sharing (package, core) are SMT siblings."""
    distances: Mapping[tuple[int, int], int] = field(default_factory=dict)
    """(from node, to node) -> distance; missing pairs are 10 to itself and 20 otherwise.
    A pair given one way is used both ways."""
    numa: bool = True
    """False: a kernel without NUMA support (then give exactly one node, node 0)."""
    l3_groups: Sequence[frozenset[int]] = ()
    """CPU sets that each share one L3 (``cache/index3``). Empty: no ``cache`` directory
    at all, as in a VM whose kernel has no cacheinfo."""

    @property
    def all_cpus(self) -> frozenset[int]:
        return frozenset().union(*(node.cpus for node in self.nodes.values()))

    @property
    def online_cpus(self) -> frozenset[int]:
        return self.all_cpus - frozenset(self.offline_cpus)

    def node_of(self, cpu: int) -> int:
        return next(node_id for node_id, node in self.nodes.items() if cpu in node.cpus)

    def package_core(self, cpu: int) -> tuple[int, int]:
        return self.cores.get(cpu, (self.node_of(cpu), cpu))

    def distance(self, a: int, b: int) -> int:
        if (a, b) in self.distances:
            return self.distances[(a, b)]
        if (b, a) in self.distances:
            return self.distances[(b, a)]
        return 10 if a == b else 20


def gpu_address(index: int) -> str:
    """The PCI address fake shapes give their ``index``-th GPU: 0000:18:00.0, 0000:28:00.0, ..."""
    domain, slot = divmod(index, 14)
    return f"{domain:04x}:{0x18 + 0x10 * slot:02x}:00.0"


def host_bridge(numa_node: int = 0) -> PciSpec:
    return PciSpec(
        "0000:00:00.0",
        numa_node,
        vendor="0x8086",
        device="0x09a2",
        pci_class=HOST_BRIDGE_CLASS,
    )


@dataclass(frozen=True)
class Shape:
    """sockets x nodes_per_socket x cores_per_node x threads_per_core, gpus_per_node GPUs per node."""

    sockets: int = 1
    nodes_per_socket: int = 1
    cores_per_node: int = 4
    threads_per_core: int = 1
    gpus_per_node: int = 0
    memory_kb_per_node: int = 32 * GIB_KB
    same_socket_distance: int = 12
    remote_distance: int = 21
    offline_cpus: frozenset[int] = frozenset()
    l3_per_node: int = 0
    """L3 groups per node, each a contiguous run of its cores (SMT siblings with them);
    0 writes no ``cache`` directory."""

    @property
    def num_nodes(self) -> int:
        return self.sockets * self.nodes_per_socket

    @property
    def num_cores(self) -> int:
        return self.num_nodes * self.cores_per_node

    def cpus_of_node(self, node_id: int) -> frozenset[int]:
        """All CPUs of a node (SMT siblings included, offline ones too)."""
        first = node_id * self.cores_per_node
        return frozenset(
            thread * self.num_cores + core
            for core in range(first, first + self.cores_per_node)
            for thread in range(self.threads_per_core)
        )

    def gpus_of_node(self, node_id: int) -> tuple[str, ...]:
        """PCI addresses of the node's GPUs; GPU i overall sits on node i // gpus_per_node."""
        first = node_id * self.gpus_per_node
        return tuple(gpu_address(i) for i in range(first, first + self.gpus_per_node))

    def l3_groups(self) -> tuple[frozenset[int], ...]:
        if not self.l3_per_node:
            return ()
        per, extra = divmod(self.cores_per_node, self.l3_per_node)
        if per == 0 or extra:
            raise ValueError(
                f"l3_per_node={self.l3_per_node} must divide cores_per_node="
                f"{self.cores_per_node}"
            )
        return tuple(
            frozenset(
                thread * self.num_cores + core
                for core in range(first, first + per)
                for thread in range(self.threads_per_core)
            )
            for first in range(0, self.num_cores, per)
        )

    @property
    def gpu_addresses(self) -> tuple[str, ...]:
        return tuple(
            addr
            for node_id in range(self.num_nodes)
            for addr in self.gpus_of_node(node_id)
        )

    def host(self) -> Host:
        cores_per_package = self.nodes_per_socket * self.cores_per_node
        cores: dict[int, tuple[int, int]] = {}
        for core in range(self.num_cores):
            package = core // cores_per_package
            for thread in range(self.threads_per_core):
                cores[thread * self.num_cores + core] = (
                    package,
                    core % cores_per_package,
                )
        distances = {}
        for a in range(self.num_nodes):
            for b in range(self.num_nodes):
                if a != b:
                    same = a // self.nodes_per_socket == b // self.nodes_per_socket
                    distances[(a, b)] = (
                        self.same_socket_distance if same else self.remote_distance
                    )
        pci = [host_bridge(0)] + [
            PciSpec(addr, node_id)
            for node_id in range(self.num_nodes)
            for addr in self.gpus_of_node(node_id)
        ]
        return Host(
            nodes={
                n: NodeSpec(
                    cpus=self.cpus_of_node(n), memory_kb=self.memory_kb_per_node
                )
                for n in range(self.num_nodes)
            },
            pci=pci,
            offline_cpus=frozenset(self.offline_cpus),
            cores=cores,
            distances=distances,
            l3_groups=self.l3_groups(),
        )


def write_sysfs(root: Union[str, os.PathLike], spec: Union[Shape, Host]) -> Path:
    """Write the sysfs tree of ``spec`` under ``root`` (which must not exist or be empty)."""
    host = spec.host() if isinstance(spec, Shape) else spec
    root = Path(root)
    if root.exists() and any(root.iterdir()):
        raise ValueError(f"{root}: is not empty; give write_sysfs a new directory")
    if not host.numa and set(host.nodes) != {0}:
        raise ValueError("Host(numa=False) needs exactly one node, node 0")
    root.mkdir(parents=True, exist_ok=True)
    _write_cpus(root, host)
    if host.numa:
        _write_nodes(root, host)
    else:
        _write_memory_blocks(root, host.nodes[0].memory_kb)
    _write_pci(root, host)
    return root


def write_proc_status(
    path: Union[str, os.PathLike], *, cpus: Iterable[int], mems: Iterable[int]
) -> Path:
    """A ``/proc/PID/status`` file whose allowed CPUs and memory nodes are ``cpus`` and ``mems``."""
    path = Path(path)
    cpus, mems = frozenset(cpus), frozenset(mems)
    path.write_text(
        "Name:\tpython3\nState:\tR (running)\nTgid:\t4242\nPid:\t4242\nThreads:\t1\n"
        f"Cpus_allowed:\t{_mask(cpus, max(cpus, default=0) + 1)}\n"
        f"Cpus_allowed_list:\t{format_cpulist(cpus)}\n"
        f"Mems_allowed:\t{_mask(mems, 1024)}\n"
        f"Mems_allowed_list:\t{format_cpulist(mems)}\n"
        "voluntary_ctxt_switches:\t1\nnonvoluntary_ctxt_switches:\t0\n"
    )
    return path


# Ready-made shapes. Each writes under ``root`` and returns it.


def one_node(root: Union[str, os.PathLike], *, cpus: int = 4) -> Path:
    """One socket, one node, ``cpus`` cores without SMT, 32 GiB, no GPU."""
    return write_sysfs(root, Shape(cores_per_node=cpus))


def two_sockets_four_gpus(root: Union[str, os.PathLike]) -> Path:
    """Two sockets = nodes 0 and 1, 8 cores x 2 threads each, 4 GPUs (2 per node), distance 21.

    node 0: CPUs 0-7,16-23, GPUs 0000:18:00.0, 0000:28:00.0
    node 1: CPUs 8-15,24-31, GPUs 0000:38:00.0, 0000:48:00.0
    """
    return write_sysfs(root, TWO_SOCKETS_FOUR_GPUS)


def sub_numa_clustering(root: Union[str, os.PathLike]) -> Path:
    """Two packages x 2 nodes (SNC2) = nodes 0-3, 4 cores x 2 threads each, 2 GPUs per node.

    node n: CPUs 4n..4n+3 and 16+4n..16+4n+3; package n // 2; distances 12 within a package,
    21 across; GPUs gpu_address(2n), gpu_address(2n + 1).
    """
    return write_sysfs(root, SUB_NUMA_CLUSTERING)


def eight_nodes(root: Union[str, os.PathLike]) -> Path:
    """Two packages x 4 nodes = nodes 0-7, 4 cores x 2 threads each (64 CPUs), one GPU per node."""
    return write_sysfs(root, EIGHT_NODES)


def sparse_nodes(root: Union[str, os.PathLike]) -> Path:
    """Only nodes 0 and 2: node 0 CPUs 0-3, node 2 CPUs 4-7 (packages 0 and 2), distance 21;
    GPU 0000:18:00.0 on node 0, GPU 0000:28:00.0 on node 2."""
    return write_sysfs(
        root,
        Host(
            nodes={0: NodeSpec(cpus=range(0, 4)), 2: NodeSpec(cpus=range(4, 8))},
            pci=[
                host_bridge(0),
                PciSpec(gpu_address(0), 0),
                PciSpec(gpu_address(1), 2),
            ],
            distances={(0, 2): 21},
        ),
    )


def cpuless_memory_nodes(root: Union[str, os.PathLike]) -> Path:
    """CPU nodes 0 (CPUs 0-3) and 1 (CPUs 4-7), 32 GiB each, plus memory-only nodes 2 and 3
    (96 GiB each, as GPU or CXL memory shows up); GPU 0000:18:00.0 on node 0, 0000:28:00.0 on
    node 1. Distances: 0-1 21, a CPU node to its memory node (0-2, 1-3) 40, others 80.
    """
    return write_sysfs(
        root,
        Host(
            nodes={
                0: NodeSpec(cpus=range(0, 4)),
                1: NodeSpec(cpus=range(4, 8)),
                2: NodeSpec(memory_kb=96 * GIB_KB),
                3: NodeSpec(memory_kb=96 * GIB_KB),
            },
            pci=[
                host_bridge(0),
                PciSpec(gpu_address(0), 0),
                PciSpec(gpu_address(1), 1),
            ],
            distances={
                (0, 1): 21,
                (0, 2): 40,
                (1, 3): 40,
                (0, 3): 80,
                (1, 2): 80,
                (2, 3): 80,
            },
        ),
    )


def gpu_unknown_node(
    root: Union[str, os.PathLike], *, nodes: int = 2, gpus: int = 2
) -> Path:
    """``nodes`` nodes of 4 CPUs (one socket each) and ``gpus`` GPUs whose ``numa_node`` is -1
    (a VM or firmware that does not report it). The host bridge stays on node 0."""
    host = Shape(sockets=nodes, cores_per_node=4).host()
    return write_sysfs(
        root,
        dataclasses.replace(
            host,
            pci=[host_bridge(0)] + [PciSpec(gpu_address(i), -1) for i in range(gpus)],
        ),
    )


def no_numa_kernel(
    root: Union[str, os.PathLike], *, cpus: int = 2, memory_kb: int = 4 * GIB_KB
) -> Path:
    """A kernel built without NUMA: no devices/system/node; memory in 128 MiB blocks."""
    return write_sysfs(
        root,
        Host(
            nodes={0: NodeSpec(cpus=range(cpus), memory_kb=memory_kb)},
            pci=[host_bridge(-1)],
            numa=False,
        ),
    )


TWO_SOCKETS_FOUR_GPUS = Shape(
    sockets=2, cores_per_node=8, threads_per_core=2, gpus_per_node=2
)
SUB_NUMA_CLUSTERING = Shape(
    sockets=2, nodes_per_socket=2, cores_per_node=4, threads_per_core=2, gpus_per_node=2
)
EIGHT_NODES = Shape(
    sockets=2, nodes_per_socket=4, cores_per_node=4, threads_per_core=2, gpus_per_node=1
)


# Writing.


def _mask(ids: frozenset[int], width: int) -> str:
    """A Linux bitmap: hex in comma-separated 32-bit groups, as in ``cpumap`` or ``Cpus_allowed``."""
    groups = max(1, (width + 31) // 32)
    value = sum(1 << i for i in ids)
    return ",".join(
        f"{(value >> (32 * g)) & 0xFFFFFFFF:08x}" for g in reversed(range(groups))
    )


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _write_cpus(root: Path, host: Host) -> None:
    base = root / "devices/system/cpu"
    present = host.all_cpus
    online = host.online_cpus
    nr_cpu_ids = max(present) + 1
    _write(base / "online", format_cpulist(online))
    _write(base / "possible", format_cpulist(range(nr_cpu_ids)))
    _write(base / "present", format_cpulist(present))
    _write(base / "offline", format_cpulist(frozenset(range(nr_cpu_ids)) - online))
    _write(base / "kernel_max", str(max(nr_cpu_ids, 8192) - 1))
    for cpu in sorted(present):
        cpu_dir = base / f"cpu{cpu}"
        cpu_dir.mkdir(parents=True, exist_ok=True)
        if cpu != 0:
            _write(cpu_dir / "online", "1" if cpu in online else "0")
        if cpu not in online:
            continue
        package, core = host.package_core(cpu)
        siblings = frozenset(
            c for c in online if host.package_core(c) == (package, core)
        )
        package_cpus = frozenset(
            c for c in online if host.package_core(c)[0] == package
        )
        topo = cpu_dir / "topology"
        _write(topo / "physical_package_id", str(package))
        _write(topo / "core_id", str(core))
        _write(topo / "die_id", "0")
        # Each set both ways, a list and a mask, as the kernel writes them (lscpu reads
        # the masks).
        for names, cpus in (
            (("thread_siblings", "core_cpus"), siblings),
            (("core_siblings", "package_cpus", "die_cpus"), package_cpus),
        ):
            for name in names:
                _write(topo / f"{name}_list", format_cpulist(cpus))
                _write(topo / name, _mask(cpus, nr_cpu_ids))
        l3 = next((g for g in host.l3_groups if cpu in g), None)
        if l3 is not None:
            _write_caches(
                cpu_dir / "cache", siblings, frozenset(l3) & online, nr_cpu_ids
            )


def _write_caches(
    base: Path, core: frozenset[int], l3: frozenset[int], nr_cpu_ids: int
) -> None:
    """L1d, L1i and L2 per core and one L3 per group, as x86's cacheinfo lays them out
    (the kernel drops offline CPUs from every ``shared_cpu_list``)."""
    for index, (level, kind, size, shared) in enumerate(
        (
            (1, "Data", "48K", core),
            (1, "Instruction", "32K", core),
            (2, "Unified", "2048K", core),
            (3, "Unified", "32768K", l3),
        )
    ):
        cache = base / f"index{index}"
        _write(cache / "level", str(level))
        _write(cache / "type", kind)
        _write(cache / "size", size)
        _write(cache / "id", str(min(shared)))
        _write(cache / "coherency_line_size", "64")
        _write(cache / "shared_cpu_list", format_cpulist(shared))
        _write(cache / "shared_cpu_map", _mask(shared, nr_cpu_ids))


def _write_nodes(root: Path, host: Host) -> None:
    base = root / "devices/system/node"
    node_ids = sorted(host.nodes)
    online = host.online_cpus
    nr_cpu_ids = max(host.all_cpus) + 1
    _write(base / "online", format_cpulist(node_ids))
    _write(base / "possible", format_cpulist(node_ids))
    _write(
        base / "has_cpu",
        format_cpulist(n for n in node_ids if host.nodes[n].cpus & online),
    )
    _write(
        base / "has_memory",
        format_cpulist(n for n in node_ids if host.nodes[n].memory_kb > 0),
    )
    _write(
        base / "has_normal_memory",
        format_cpulist(n for n in node_ids if host.nodes[n].memory_kb > 0),
    )
    for node_id in node_ids:
        spec = host.nodes[node_id]
        node_dir = base / f"node{node_id}"
        cpus = spec.cpus & online
        _write(node_dir / "cpulist", format_cpulist(cpus))
        _write(node_dir / "cpumap", _mask(cpus, nr_cpu_ids))
        free = spec.memory_kb * 9 // 10
        _write(
            node_dir / "meminfo",
            f"Node {node_id} MemTotal:       {spec.memory_kb:8d} kB\n"
            f"Node {node_id} MemFree:        {free:8d} kB\n"
            f"Node {node_id} MemUsed:        {spec.memory_kb - free:8d} kB\n"
            f"Node {node_id} HugePages_Total:     0\n"
            f"Node {node_id} HugePages_Free:      0",
        )
        _write(
            node_dir / "distance",
            " ".join(str(host.distance(node_id, other)) for other in node_ids),
        )


def _write_memory_blocks(root: Path, memory_kb: int) -> None:
    if memory_kb <= 0 or memory_kb % MEMORY_BLOCK_KB:
        raise ValueError(
            f"memory_kb={memory_kb} must be a positive multiple of {MEMORY_BLOCK_KB} (128 MiB)"
        )
    base = root / "devices/system/memory"
    _write(base / "block_size_bytes", f"{MEMORY_BLOCK_KB * 1024:x}")
    _write(base / "auto_online_blocks", "online")
    for block in range(memory_kb // MEMORY_BLOCK_KB):
        _write(base / f"memory{block}/online", "1")
        _write(base / f"memory{block}/state", "online")


def _write_pci(root: Path, host: Host) -> None:
    links = root / "bus/pci/devices"
    links.mkdir(parents=True, exist_ok=True)
    all_cpus = host.online_cpus
    nr_cpu_ids = max(host.all_cpus) + 1
    for dev in host.pci:
        domain, bus, _ = dev.address.split(":", 2)
        rel = Path("devices") / f"pci{domain}:{bus}" / dev.address
        (links / dev.address).symlink_to(Path("../../..") / rel)
        if dev.vanished:
            continue
        node: Optional[NodeSpec] = (
            host.nodes.get(dev.numa_node) if dev.numa_node >= 0 else None
        )
        local = node.cpus & all_cpus if node is not None and node.cpus else all_cpus
        files = {
            "vendor": dev.vendor,
            "device": dev.device,
            "class": dev.pci_class,
            "local_cpulist": format_cpulist(local),
            "local_cpus": _mask(local, nr_cpu_ids),
        }
        if host.numa:
            files["numa_node"] = str(dev.numa_node)
        for name, text in files.items():
            if name not in dev.missing:
                _write(root / rel / name, text)
        (root / rel).mkdir(parents=True, exist_ok=True)
