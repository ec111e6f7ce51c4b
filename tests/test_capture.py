"""``capture DIR``: the sysfs files the core and ``plan`` read, copied so that ``plan
--sysfs-root DIR`` plans that host elsewhere."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import fakesys
import pytest
import tools_hosts

PROG = "python -m sglang.srt.placement_tools"


@pytest.fixture
def scratch():
    with tempfile.TemporaryDirectory(prefix="tools-capture-") as directory:
        yield Path(directory)


def capture(dest: Path, root=None):
    argv = ["capture", str(dest)] + (
        [] if root is None else ["--sysfs-root", str(root)]
    )
    return tools_hosts.run_tools(argv)


def test_a_capture_plans_its_host_elsewhere(scratch):
    """A capture of a two-socket host (its PCI devices links into devices/pci*, as in
    /sys) holds plain files, and plan reads it as that host: each GPU's node, and
    SGLANG_SET_CPU_AFFINITY's slices, which need lscpu's topology files."""
    tree = tools_hosts.write_tree(scratch / "sys", fakesys.TWO_SOCKETS_FOUR_GPUS)
    snap = scratch / "snap"
    done = capture(snap, tree)
    assert done.returncode == 0, done.stderr
    files = [p for p in snap.rglob("*") if p.is_file()]
    assert done.stdout == (
        f"copied {len(files) - 1} files from {tree} to {snap}; plan with: "
        f"{PROG} plan --sysfs-root {snap}\n"
    )
    assert not any(p.is_symlink() for p in snap.rglob("*"))
    for rel in ("devices/system/node/node1/cpulist", "devices/system/cpu/online"):
        assert (snap / rel).read_text() == (tree / rel).read_text()
    gpu = "bus/pci/devices/0000:38:00.0/numa_node"
    assert (snap / gpu).read_text() == "1\n"
    marker = json.loads((snap / "sglang-placement-snapshot.json").read_text())
    assert marker["source_root"] == str(tree) and marker["format"] == 1
    argv = ["plan", "--sysfs-root", str(snap), "--tp-size", "4", "--set-cpu-affinity"]
    rows = tools_hosts.ranks(tools_hosts.run_tools([*argv, "--json"]))
    assert [(r["pci"], r["numa_node"], r["cpus"]) for r in rows] == [
        (fakesys.gpu_address(0), 0, "0-3,16-19"),
        (fakesys.gpu_address(1), 0, "4-7,20-23"),
        (fakesys.gpu_address(2), 1, "8-11,24-27"),
        (fakesys.gpu_address(3), 1, "12-15,28-31"),
    ]


def test_capture_of_this_host(scratch):
    snap = scratch / "snap"
    done = capture(snap)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("copied ") and " from /sys to " in done.stdout
    for rel in ("devices/system/cpu/online", "devices/system/node/node0/cpulist"):
        assert (snap / rel).read_text() == Path("/sys", rel).read_text()
    topology = snap / "devices/system/cpu/cpu0/topology/core_siblings"
    assert topology.read_text() == Path("/sys", topology.relative_to(snap)).read_text()
    assert os.stat(snap).st_mode & 0o777 == 0o755


def test_capture_refuses_a_used_directory_and_leaves_nothing(scratch):
    used = scratch / "used"
    used.mkdir()
    (used / "keep").write_text("mine\n")
    for dest, message in (
        (used, f"DIR {used}: is not empty"),
        (scratch / "missing/snap", "its parent"),
        (used / "keep", "exists and is not a directory"),
    ):
        done = capture(dest)
        assert done.returncode == 2 and not done.stdout, done
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], lines
    assert sorted(p.name for p in scratch.rglob("*")) == ["keep", "used"]


def test_capture_needs_a_sysfs_root(scratch):
    done = capture(scratch / "snap", scratch)
    assert done.returncode == 2
    assert f"--sysfs-root {scratch}: not a sysfs tree or snapshot" in done.stderr
    assert list(scratch.iterdir()) == []
