"""capture_sysfs: a snapshot holds exactly what read_topology reads and reads back the same."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import stat

import fakesys
import pytest

from sglang.srt.placement.topology import SNAPSHOT_MARKER, read_topology
from sglang.srt.placement.types import PlacementError
from sglang.srt.placement_tools import UsageError
from sglang.srt.placement_tools.capture import capture_sysfs

READY_MADE = [
    fakesys.one_node,
    fakesys.two_sockets_four_gpus,
    fakesys.sub_numa_clustering,
    fakesys.sparse_nodes,
    fakesys.cpuless_memory_nodes,
    fakesys.gpu_unknown_node,
    fakesys.eight_nodes,
    fakesys.no_numa_kernel,
]


def files_under(root):
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            found[os.path.relpath(path, root)] = os.lstat(path)
    return found


def assert_same_topology(snapshot, original):
    assert read_topology(snapshot) == dataclasses.replace(original, root=str(snapshot))


def test_capture_of_this_hosts_sysfs_round_trips(tmp_path):
    dest = tmp_path / "snap"
    count = capture_sysfs(dest)
    assert_same_topology(dest, read_topology("/sys"))

    entries = files_under(dest)
    files = {rel for rel, st in entries.items() if stat.S_ISREG(st.st_mode)}
    assert len(files) == count + 1  # and the marker
    assert SNAPSHOT_MARKER in files
    assert not any(stat.S_ISLNK(st.st_mode) for st in entries.values())
    for rel, st in entries.items():
        assert (
            stat.S_IMODE(st.st_mode) & 0o022 == 0
        ), f"{rel} is group- or world-writable"
        assert (
            stat.S_IMODE(st.st_mode) & ~(0o755 if stat.S_ISDIR(st.st_mode) else 0o644)
            == 0
        )
    pci_dirs = os.listdir(dest / "bus/pci/devices")
    assert sorted(pci_dirs) == sorted(os.listdir("/sys/bus/pci/devices"))


def test_marker_names_the_kernel_and_time(tmp_path):
    capture_sysfs(tmp_path / "snap", root=fakesys.one_node(tmp_path / "sys"))
    marker = json.loads((tmp_path / "snap" / SNAPSHOT_MARKER).read_text())
    assert marker["format"] == 1
    assert marker["kernel_release"] == os.uname().release
    captured = datetime.datetime.fromisoformat(marker["captured_at"])
    assert abs(
        datetime.datetime.now(datetime.timezone.utc) - captured
    ) < datetime.timedelta(hours=1)
    assert marker["source_root"] == str(tmp_path / "sys")


@pytest.mark.parametrize("make", READY_MADE, ids=[make.__name__ for make in READY_MADE])
def test_capture_of_fake_trees_round_trips(tmp_path, make):
    root = make(tmp_path / "sys")
    count = capture_sysfs(tmp_path / "snap", root=root)
    assert count > 0
    assert_same_topology(tmp_path / "snap", read_topology(root))
    # A snapshot of a snapshot is the same again.
    assert capture_sysfs(tmp_path / "again", root=tmp_path / "snap") == count
    assert_same_topology(tmp_path / "again", read_topology(root))


def test_capture_copies_exactly_the_files_read(tmp_path):
    root = fakesys.write_sysfs(
        tmp_path / "sys",
        fakesys.Host(
            nodes={0: fakesys.NodeSpec(cpus=range(2))},
            pci=[fakesys.PciSpec("0000:18:00.0", -1)],
            offline_cpus=frozenset({1}),
        ),
    )
    # cpu1 is offline: its files are not read; nor are cpumap, has_cpu, local_cpulist and the like.
    assert capture_sysfs(tmp_path / "snap", root=root) == 10
    files = {
        rel
        for rel, st in files_under(tmp_path / "snap").items()
        if stat.S_ISREG(st.st_mode)
    }
    assert files == {
        SNAPSHOT_MARKER,
        "devices/system/cpu/online",
        "devices/system/cpu/cpu0/topology/physical_package_id",
        "devices/system/cpu/cpu0/topology/core_id",
        "devices/system/cpu/cpu0/topology/thread_siblings_list",
        "devices/system/node/node0/cpulist",
        "devices/system/node/node0/meminfo",
        "bus/pci/devices/0000:18:00.0/numa_node",
        "bus/pci/devices/0000:18:00.0/vendor",
        "bus/pci/devices/0000:18:00.0/device",
        "bus/pci/devices/0000:18:00.0/class",
    }
    assert read_topology(tmp_path / "snap").pci_devices[0].numa_node is None


def test_modes_do_not_depend_on_a_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        capture_sysfs(
            tmp_path / "snap", root=fakesys.two_sockets_four_gpus(tmp_path / "sys")
        )
    finally:
        os.umask(old)
    for rel, st in files_under(tmp_path / "snap").items():
        expected = 0o755 if stat.S_ISDIR(st.st_mode) else 0o644
        assert stat.S_IMODE(st.st_mode) == expected, rel
    assert stat.S_IMODE(os.stat(tmp_path / "snap").st_mode) == 0o755


def test_capture_into_an_empty_directory(tmp_path):
    (tmp_path / "snap").mkdir()
    capture_sysfs(tmp_path / "snap", root=fakesys.one_node(tmp_path / "sys"))
    assert (tmp_path / "snap" / SNAPSHOT_MARKER).is_file()


def test_capture_into_a_non_empty_directory(tmp_path):
    dest = tmp_path / "snap"
    dest.mkdir()
    (dest / "notes.txt").write_text("keep me")
    with pytest.raises(UsageError) as err:
        capture_sysfs(dest, root=fakesys.one_node(tmp_path / "sys"))
    assert str(err.value).startswith(
        f"{dest}: is not empty; choose a new or empty directory"
    )
    assert os.listdir(dest) == ["notes.txt"]


def test_capture_onto_a_file_or_under_a_missing_parent(tmp_path):
    root = fakesys.one_node(tmp_path / "sys")
    (tmp_path / "file").write_text("")
    with pytest.raises(
        UsageError, match=f"{tmp_path}/file: exists and is not a directory"
    ):
        capture_sysfs(tmp_path / "file", root=root)
    with pytest.raises(
        UsageError,
        match=f"{tmp_path}/no/snap: its parent {tmp_path}/no does not exist",
    ):
        capture_sysfs(tmp_path / "no" / "snap", root=root)


def test_failed_read_leaves_nothing_behind(tmp_path):
    root = fakesys.one_node(tmp_path / "sys")
    (root / "devices/system/cpu/online").unlink()
    with pytest.raises(PlacementError, match="devices/system/cpu/online: missing"):
        capture_sysfs(tmp_path / "snap", root=root)
    assert not (tmp_path / "snap").exists()


def test_truncated_snapshot_names_the_capture_command(tmp_path):
    capture_sysfs(tmp_path / "snap", root=fakesys.sub_numa_clustering(tmp_path / "sys"))
    (tmp_path / "snap/devices/system/node/node2/meminfo").unlink()
    with pytest.raises(PlacementError) as err:
        read_topology(tmp_path / "snap")
    message = str(err.value)
    assert message.startswith(
        f"{tmp_path}/snap/devices/system/node/node2/meminfo: missing; "
    )
    assert f"captured from kernel {os.uname().release}" in message
    assert "re-capture it on the host it describes" in message
