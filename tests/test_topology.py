"""read_topology and read_process_affinity: fake trees for shapes this host lacks, the real /sys for this one."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import fakesys
import pytest
from fakesys import GIB_KB, Host, NodeSpec, PciSpec, Shape

from sglang.srt.placement.topology import (
    SNAPSHOT_MARKER,
    read_process_affinity,
    read_topology,
)
from sglang.srt.placement.types import Cpu, PlacementError

CAPTURE_FIX = "re-capture it on the host it describes"
TREE_FIX = "placement reads this host's NUMA topology there: is sysfs mounted?"


def gpus(topology):
    return {
        dev.address: dev.numa_node
        for dev in topology.pci_devices
        if dev.vendor == fakesys.NVIDIA_VENDOR
    }


@pytest.mark.parametrize(
    "shape",
    [
        fakesys.TWO_SOCKETS_FOUR_GPUS,
        fakesys.SUB_NUMA_CLUSTERING,
        fakesys.EIGHT_NODES,
        Shape(cores_per_node=3),
        Shape(sockets=4, cores_per_node=2, threads_per_core=4, gpus_per_node=1),
    ],
    ids=[
        "two_sockets_four_gpus",
        "sub_numa_clustering",
        "eight_nodes",
        "one_node_3",
        "four_sockets_smt4",
    ],
)
def test_shape_reads_back_exactly(tmp_path, shape):
    topology = read_topology(fakesys.write_sysfs(tmp_path / "sys", shape))

    assert topology.root == str(tmp_path / "sys")
    assert topology.node_ids == tuple(range(shape.num_nodes))
    all_cpus = frozenset(range(shape.num_cores * shape.threads_per_core))
    assert topology.online_cpus == all_cpus
    assert tuple(cpu.cpu_id for cpu in topology.cpus) == tuple(sorted(all_cpus))
    for node in topology.nodes:
        assert node.cpus == shape.cpus_of_node(node.node_id)
        assert node.memory_kb == shape.memory_kb_per_node
        packages = {c.package_id for c in topology.cpus if c.node_id == node.node_id}
        assert packages == {node.node_id // shape.nodes_per_socket}
    for cpu in topology.cpus:
        core = cpu.cpu_id % shape.num_cores
        assert cpu.thread_siblings == {
            core + t * shape.num_cores for t in range(shape.threads_per_core)
        }
        assert cpu.node_id == core // shape.cores_per_node
    assert gpus(topology) == {
        addr: node_id
        for node_id in range(shape.num_nodes)
        for addr in shape.gpus_of_node(node_id)
    }
    bridge = topology.pci_device("0000:00:00.0")
    assert bridge is not None and bridge.pci_class == fakesys.HOST_BRIDGE_CLASS


def test_two_sockets_four_gpus(tmp_path):
    topology = read_topology(fakesys.two_sockets_four_gpus(tmp_path))
    assert topology.node(0).cpus == frozenset(range(0, 8)) | frozenset(range(16, 24))
    assert topology.node(1).cpus == frozenset(range(8, 16)) | frozenset(range(24, 32))
    assert topology.cpu(17) == Cpu(
        cpu_id=17,
        node_id=0,
        package_id=0,
        core_id=1,
        thread_siblings=frozenset({1, 17}),
    )
    assert topology.cpu(9).core_id == 1 and topology.cpu(9).package_id == 1
    assert gpus(topology) == {
        "0000:18:00.0": 0,
        "0000:28:00.0": 0,
        "0000:38:00.0": 1,
        "0000:48:00.0": 1,
    }
    gpu = topology.pci_device("0000:38:00.0")
    assert (gpu.vendor, gpu.device, gpu.pci_class) == ("0x10de", "0x2330", "0x030200")


def test_sub_numa_clustering_packages(tmp_path):
    topology = read_topology(fakesys.sub_numa_clustering(tmp_path))
    assert topology.node_ids == (0, 1, 2, 3)
    for package, nodes in ((0, {0, 1}), (1, {2, 3})):
        assert {c.node_id for c in topology.cpus if c.package_id == package} == nodes
    assert topology.node(2).cpus == {8, 9, 10, 11, 24, 25, 26, 27}
    assert sum(1 for node in gpus(topology).values() if node == 3) == 2


def test_sparse_node_ids(tmp_path):
    topology = read_topology(fakesys.sparse_nodes(tmp_path))
    assert topology.node_ids == (0, 2)
    assert topology.node(1) is None
    assert topology.node(2).cpus == {4, 5, 6, 7}
    assert topology.cpu(5).node_id == 2 and topology.cpu(5).package_id == 2
    assert gpus(topology) == {"0000:18:00.0": 0, "0000:28:00.0": 2}


def test_memory_only_nodes(tmp_path):
    topology = read_topology(fakesys.cpuless_memory_nodes(tmp_path))
    assert topology.node_ids == (0, 1, 2, 3)
    assert [node.node_id for node in topology.cpu_nodes] == [0, 1]
    for node_id in (2, 3):
        node = topology.node(node_id)
        assert node.cpus == frozenset()
        assert node.memory_kb == 96 * GIB_KB and node.has_memory
    assert {cpu.node_id for cpu in topology.cpus} == {0, 1}


def test_cpu_node_without_memory(tmp_path):
    root = fakesys.write_sysfs(
        tmp_path,
        Host(
            nodes={
                0: NodeSpec(cpus=range(2)),
                1: NodeSpec(cpus=range(2, 4), memory_kb=0),
            }
        ),
    )
    topology = read_topology(root)
    assert topology.node(1).cpus == {2, 3}
    assert topology.node(1).memory_kb == 0 and not topology.node(1).has_memory
    assert topology.node(0).has_memory


def test_gpu_with_unknown_node(tmp_path):
    topology = read_topology(fakesys.gpu_unknown_node(tmp_path))
    assert gpus(topology) == {"0000:18:00.0": None, "0000:28:00.0": None}
    assert topology.node_ids == (0, 1)


def test_pci_address_is_canonical_lower_case(tmp_path):
    root = fakesys.write_sysfs(
        tmp_path,
        Host(nodes={0: NodeSpec(cpus=range(2))}, pci=[PciSpec("0000:AB:00.0", 0)]),
    )
    topology = read_topology(root)
    assert [dev.address for dev in topology.pci_devices] == ["0000:ab:00.0"]
    assert topology.pci_device("0000:AB:00.0").numa_node == 0


def test_offline_cpus_are_excluded(tmp_path):
    shape = Shape(
        sockets=2, cores_per_node=4, threads_per_core=2, offline_cpus=frozenset({5, 13})
    )
    topology = read_topology(fakesys.write_sysfs(tmp_path, shape))
    assert topology.online_cpus == frozenset(range(16)) - {5, 13}
    assert topology.cpu(5) is None and topology.cpu(13) is None
    assert topology.node(1).cpus == {4, 6, 7, 12, 14, 15}
    # CPU 5's sibling 13 is offline too; CPU 4's sibling 12 is online.
    assert topology.cpu(4).thread_siblings == {4, 12}


def test_offline_cpu_still_in_node_cpulist_is_excluded(tmp_path):
    # Some architectures keep an offline CPU in its node's cpulist; it still cannot run anything.
    root = fakesys.write_sysfs(
        tmp_path, Shape(cores_per_node=4, offline_cpus=frozenset({2}))
    )
    (root / "devices/system/node/node0/cpulist").write_text("0-3\n")
    topology = read_topology(root)
    assert topology.node(0).cpus == {0, 1, 3}
    assert topology.cpu(2) is None


def test_kernel_without_numa(tmp_path):
    topology = read_topology(
        fakesys.no_numa_kernel(tmp_path, cpus=3, memory_kb=4 * GIB_KB)
    )
    assert len(topology.nodes) == 1
    node = topology.nodes[0]
    # Its memory is all the host's, as its CPUs are: no file needs to say how much.
    assert (node.node_id, node.cpus, node.memory_kb, node.has_memory) == (
        0,
        {0, 1, 2},
        None,
        True,
    )
    assert {cpu.node_id for cpu in topology.cpus} == {0}
    assert topology.pci_devices[0].numa_node is None


def test_real_sysfs_of_this_host():
    topology = read_topology("/sys")
    assert topology.root == "/sys"
    node_dirs = sorted(
        int(name[4:])
        for name in os.listdir("/sys/devices/system/node")
        if name[4:].isdigit() and name[:4] == "node"
    )
    assert list(topology.node_ids) == node_dirs
    assert os.sched_getaffinity(0) <= topology.online_cpus
    assert os.sched_getaffinity(0) <= frozenset().union(
        *(node.cpus for node in topology.nodes)
    )
    assert all(cpu.cpu_id in cpu.thread_siblings for cpu in topology.cpus)
    assert sum(node.memory_kb for node in topology.nodes) > 0
    assert [dev.address for dev in topology.pci_devices] == sorted(
        os.listdir("/sys/bus/pci/devices")
    )
    for dev in topology.pci_devices:
        with open(f"/sys/bus/pci/devices/{dev.address}/vendor") as f:
            assert dev.vendor == f.read().strip()


def test_process_affinity_of_this_process():
    affinity = read_process_affinity()
    assert affinity.cpus == frozenset(os.sched_getaffinity(0))
    assert affinity.mems and affinity.mems <= set(read_topology("/sys").node_ids)
    assert affinity.source == "this process"


def test_process_affinity_under_numactl():
    numactl = shutil.which("numactl")
    assert numactl, "numactl must be installed (Debian package numactl)"
    cpu = max(os.sched_getaffinity(0))
    code = (
        "from sglang.srt.placement.topology import read_process_affinity as r; "
        "a = r(); print(sorted(a.cpus), sorted(a.mems))"
    )
    out = subprocess.run(
        [numactl, f"--physcpubind={cpu}", "--membind=0", sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert out.strip() == f"[{cpu}] [0]"


def test_process_affinity_from_a_status_file(tmp_path):
    path = fakesys.write_proc_status(
        tmp_path / "status", cpus={0, 1, 2, 3, 8, 10, 11}, mems={1, 3}
    )
    affinity = read_process_affinity(path)
    assert affinity.cpus == {0, 1, 2, 3, 8, 10, 11}
    assert affinity.mems == {1, 3}
    assert affinity.source == "this process"


def test_process_affinity_errors(tmp_path):
    with pytest.raises(
        PlacementError, match=f"{tmp_path}/missing: missing; pass the status file"
    ):
        read_process_affinity(tmp_path / "missing")
    status = tmp_path / "status"
    status.write_text("Name:\tx\nCpus_allowed_list:\t0-3\n")
    with pytest.raises(
        PlacementError, match=f"{status}: has no Mems_allowed_list line"
    ):
        read_process_affinity(status)
    status.write_text("Cpus_allowed_list:\t0-x\nMems_allowed_list:\t0\n")
    with pytest.raises(PlacementError, match="Cpus_allowed_list"):
        read_process_affinity(status)


# Broken trees: each error names the file, what is wrong and the fix.


def broken(tmp_path, edit, *, snapshot=False):
    root = fakesys.two_sockets_four_gpus(tmp_path / "sys")
    if snapshot:
        (root / SNAPSHOT_MARKER).write_text(
            json.dumps(
                {
                    "format": 1,
                    "kernel_release": "6.1.0-test",
                    "captured_at": "2026-01-01T00:00:00+00:00",
                }
            )
        )
    edit(root)
    with pytest.raises(PlacementError) as err:
        read_topology(root)
    return root, str(err.value)


def test_root_that_does_not_exist(tmp_path):
    with pytest.raises(PlacementError) as err:
        read_topology(tmp_path / "nowhere")
    assert str(err.value).startswith(f"{tmp_path}/nowhere: does not exist; {TREE_FIX}")
    with pytest.raises(PlacementError) as err:
        read_topology(tmp_path / "nowhere", setting="--sysfs-root")
    assert str(err.value).startswith(
        f"--sysfs-root={tmp_path}/nowhere: does not exist; pass --sysfs-root pointing at a sysfs tree"
    )


def test_missing_cpu_online_in_a_snapshot(tmp_path):
    root, message = broken(
        tmp_path, lambda r: (r / "devices/system/cpu/online").unlink(), snapshot=True
    )
    assert message.startswith(f"{root}/devices/system/cpu/online: missing; ")
    assert "captured from kernel 6.1.0-test" in message
    assert CAPTURE_FIX in message


def test_missing_cpu_online_in_a_plain_tree(tmp_path):
    root, message = broken(
        tmp_path, lambda r: (r / "devices/system/cpu/online").unlink()
    )
    assert message.startswith(f"{root}/devices/system/cpu/online: missing; {TREE_FIX}")


def test_cpulist_that_does_not_parse(tmp_path):
    root, message = broken(
        tmp_path,
        lambda r: (r / "devices/system/node/node1/cpulist").write_text("8-x\n"),
        snapshot=True,
    )
    assert (
        f"{root}/devices/system/node/node1/cpulist: '8-x' is not a CPU list" in message
    )
    assert CAPTURE_FIX in message


def test_meminfo_without_memtotal(tmp_path):
    root, message = broken(
        tmp_path,
        lambda r: (r / "devices/system/node/node0/meminfo").write_text(
            "Node 0 MemFree:  100 kB\n"
        ),
        snapshot=True,
    )
    assert (
        f"{root}/devices/system/node/node0/meminfo: has no 'Node N MemTotal: <size> kB' line"
        in message
    )
    assert CAPTURE_FIX in message


def test_node_entry_that_is_not_a_directory(tmp_path):
    def edit(root):
        shutil.rmtree(root / "devices/system/node/node1")
        (root / "devices/system/node/node1").write_text("")

    root, message = broken(tmp_path, edit, snapshot=True)
    assert f"{root}/devices/system/node/node1: is not a directory" in message
    assert CAPTURE_FIX in message


def test_missing_cpu_topology(tmp_path):
    root, message = broken(
        tmp_path,
        lambda r: shutil.rmtree(r / "devices/system/cpu/cpu3/topology"),
        snapshot=True,
    )
    assert message.startswith(
        f"{root}/devices/system/cpu/cpu3/topology/physical_package_id: missing; "
    )
    assert CAPTURE_FIX in message


def test_dangling_pci_link(tmp_path):
    root, message = broken(
        tmp_path, lambda r: shutil.rmtree(r / "devices/pci0000:28/0000:28:00.0")
    )
    assert (
        f"{root}/bus/pci/devices/0000:28:00.0: does not lead to a device directory"
        in message
    )


def test_numa_node_that_is_not_a_number(tmp_path):
    root, message = broken(
        tmp_path,
        lambda r: (r / "bus/pci/devices/0000:18:00.0/numa_node").write_text("zero\n"),
    )
    assert (
        f"{root}/bus/pci/devices/0000:18:00.0/numa_node: 'zero' is not an integer"
        in message
    )


def test_snapshot_from_a_newer_format(tmp_path):
    def edit(root):
        (root / SNAPSHOT_MARKER).write_text(json.dumps({"format": 99}))

    root, message = broken(tmp_path, edit)
    assert message.startswith(
        f"{root}/{SNAPSHOT_MARKER}: snapshot format 99 is newer than this version reads (1)"
    )


def test_reading_has_no_cached_state(tmp_path):
    root = fakesys.one_node(tmp_path, cpus=4)
    first = read_topology(root)
    (root / "devices/system/node/node0/meminfo").write_text(
        "Node 0 MemTotal:  1024 kB\n"
    )
    assert read_topology(root).node(0).memory_kb == 1024
    assert first.node(0).memory_kb == 32 * GIB_KB


def test_placement_package_does_not_import_torch():
    code = "import sys, sglang.srt.placement.topology; print('torch' in sys.modules, 'ray' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert out.strip() == "False False"


def test_fake_tree_uses_real_sysfs_layout(tmp_path):
    root = fakesys.two_sockets_four_gpus(tmp_path)
    link = root / "bus/pci/devices/0000:18:00.0"
    assert link.is_symlink()
    assert os.readlink(link) == "../../../devices/pci0000:18/0000:18:00.0"
    node = root / "devices/system/node"
    assert (node / "online").read_text() == "0-1\n"
    assert (node / "has_cpu").read_text() == "0-1\n"
    assert (node / "node1/cpumap").read_text() == "ff00ff00\n"
    assert (root / "devices/system/cpu/cpu0/online").exists() is False
    assert (root / "devices/system/cpu/cpu1/online").read_text() == "1\n"
    assert (
        root / "devices/system/cpu/cpu1/topology/thread_siblings"
    ).read_text() == "00020002\n"
    meminfo = (node / "node0/meminfo").read_text().splitlines()[0]
    assert meminfo == f"Node 0 MemTotal:       {32 * GIB_KB:8d} kB"
    # Same formats as this host's real /sys.
    real = Path("/sys/devices/system/node/node0/meminfo").read_text().splitlines()[0]
    assert real.split(":")[0] == "Node 0 MemTotal" and real.endswith(" kB")
    assert Path("/sys/bus/pci/devices").iterdir().__next__().is_symlink()


def test_the_cached_topology_is_read_again_when_online_cpus_change(
    tmp_path, monkeypatch
):
    from sglang.srt.placement import topology

    root = fakesys.one_node(tmp_path / "sys", cpus=4)
    monkeypatch.setattr(topology, "SYSFS_ROOT", str(root))
    first = topology.read_topology_cached()
    assert topology.read_topology_cached() is first
    (root / "devices/system/cpu/online").write_text("0-2\n")
    assert topology.read_topology_cached().online_cpus == frozenset({0, 1, 2})


def test_offline_cpus_are_left_out(tmp_path):
    shape = fakesys.Shape(
        sockets=2, cores_per_node=4, threads_per_core=2, offline_cpus=frozenset({9})
    )
    topo = read_topology(fakesys.write_sysfs(tmp_path / "sys", shape))
    assert topo.cpu(9) is None and 9 not in topo.online_cpus
    assert topo.cores_within(topo.online_cpus)[0] == frozenset({0, 8})
