"""Reading a binding back: this process, children under real numactl, crafted /proc text."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys

import pytest

from sglang.srt.placement.cpulist import parse_cpulist
from sglang.srt.placement.types import (
    DeviceIndex,
    DeviceRef,
    PlacementError,
    ProcessPlacement,
    RankIdentity,
)
from sglang.srt.placement_tools import verify
from sglang.srt.placement_tools.verify import (
    ObservedBinding,
    compare_binding,
    observe_self,
    parse_numa_maps,
)

NUMACTL = shutil.which("numactl")

NUMA_MAPS = """\
55d0c0a00000 default file=/usr/bin/python3.11 mapped=10 N0=6 N1=4 kernelpagesize_kB=4
55d0c1000000 default heap anon=300 dirty=300 N0=100 N1=200 kernelpagesize_kB=4
7f0000000000 bind:1 anon=2 dirty=2 N1=2 kernelpagesize_kB=2048
7f1000000000 default file=/dev/shm/seg mapped=8 N3=8 kernelpagesize_kB=4
7f2000000000 default
7ffd00000000 default stack anon=5 dirty=5 N0=5 kernelpagesize_kB=4
"""


def placement(**changes) -> ProcessPlacement:
    fields = dict(
        rank=RankIdentity(DeviceRef(DeviceIndex.LOGICAL_GPU, 2), 1, 0, 2),
        pci=None,
        numa_node=1,
        cpus=frozenset({2, 3}),
        mem_nodes=frozenset({1}),
        mem_policy="bind",
        strategy="in-process",
        reasons=(),
    )
    fields.update(changes)
    return ProcessPlacement(**fields)


def observed(**changes) -> ObservedBinding:
    fields = dict(
        cpus=frozenset({2, 3}),
        mems=frozenset({0, 1}),
        policy="bind",
        policy_nodes=frozenset({1}),
    )
    fields.update(changes)
    return ObservedBinding(**fields)


def _mems_allowed_of_self() -> frozenset[int]:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Mems_allowed_list:"):
                return parse_cpulist(line.split(":", 1)[1])
    raise AssertionError("no Mems_allowed_list")


def _observe_in_child(*prefix: str) -> dict:
    code = "from sglang.srt.placement_tools.verify import observe_self; import json; print(json.dumps(observe_self().to_dict()))"
    proc = subprocess.run(
        [*prefix, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


# -- this host, for real -----------------------------------------------------------------------


def test_this_process_matches_the_kernel():
    obs = observe_self()
    assert obs.cpus == os.sched_getaffinity(0)
    assert obs.mems == _mems_allowed_of_self()
    assert obs.policy == "default" and obs.policy_nodes == frozenset()
    resident, anon = dict(obs.resident_kb), dict(obs.anon_kb)
    assert sum(resident.values()) > 1024
    assert 0 < sum(anon.values()) < sum(resident.values())
    assert obs.local_page_ratio(obs.mems) == 1.0


def test_child_under_numactl_membind_reads_back_bind():
    assert NUMACTL, "numactl must be installed (Debian package numactl)"
    out = ObservedBinding.from_dict(
        _observe_in_child(NUMACTL, "--physcpubind=0", "--membind=0")
    )
    assert out.cpus == {0}
    assert (out.policy, out.policy_nodes) == ("bind", {0})
    assert out.local_page_ratio([0]) == 1.0
    plan = placement(numa_node=0, cpus=frozenset({0}), mem_nodes=frozenset({0}))
    assert compare_binding(plan, out) == []


def test_child_under_numactl_preferred_reads_back_preferred():
    out = ObservedBinding.from_dict(_observe_in_child(NUMACTL, "--preferred=0"))
    assert (out.policy, out.policy_nodes) == ("preferred", {0})
    plan = placement(
        numa_node=0, cpus=out.cpus, mem_nodes=frozenset({0}), mem_policy="preferred"
    )
    assert compare_binding(plan, out) == []


def test_observe_module_does_not_import_torch():
    code = (
        "import sys\n"
        "import sglang.srt.placement_tools.verify, sglang.srt.placement.apply, sglang.srt.placement.libnuma\n"
        "print('torch' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


# -- crafted text ------------------------------------------------------------------------------


def test_numa_maps_sums_pages_per_node_in_kb():
    resident, anon = parse_numa_maps(NUMA_MAPS)
    assert resident == {
        0: (6 + 100 + 5) * 4,
        1: (4 + 200) * 4 + 2 * 2048,
        3: 8 * 4,
    }
    assert anon == {0: (100 + 5) * 4, 1: 200 * 4 + 2 * 2048}


def crafted(monkeypatch, tmp_path, policy=("default", frozenset())):
    """observe_self reads ``tmp_path/self`` and is told ``policy`` by get_mempolicy."""
    monkeypatch.setattr(verify, "_PROC_SELF", str(tmp_path / "self"))
    if policy is not None:
        monkeypatch.setattr(verify, "read_mempolicy", lambda: policy)


def test_observe_from_a_crafted_proc_tree(tmp_path, monkeypatch):
    pid_dir = tmp_path / "self"
    pid_dir.mkdir()
    (pid_dir / "status").write_text(
        "Name:\tpython\nCpus_allowed:\t0c\nCpus_allowed_list:\t2-3\nMems_allowed:\t3\nMems_allowed_list:\t0-1\n"
    )
    (pid_dir / "numa_maps").write_text(NUMA_MAPS)
    crafted(monkeypatch, tmp_path, ("bind", frozenset({1})))
    obs = observe_self()
    assert obs.cpus == {2, 3} and obs.mems == {0, 1}
    assert (obs.policy, obs.policy_nodes) == ("bind", {1})
    total = sum(kb for _, kb in obs.resident_kb)
    assert obs.local_page_ratio([1]) == pytest.approx(
        ((4 + 200) * 4 + 2 * 2048) / total
    )
    assert obs.local_page_ratio([1], anon_only=True) == pytest.approx(
        (200 * 4 + 2 * 2048) / ((305) * 4 + 2 * 2048)
    )
    assert ObservedBinding.from_dict(obs.to_dict()) == obs


def test_crafted_tree_without_numa_maps_counts_nothing(tmp_path, monkeypatch):
    pid_dir = tmp_path / "self"
    pid_dir.mkdir()
    (pid_dir / "status").write_text("Cpus_allowed_list:\t0\nMems_allowed_list:\t0\n")
    crafted(monkeypatch, tmp_path)
    obs = observe_self()
    assert obs.cpus == {0} and obs.local_page_ratio([0]) is None


def test_a_host_without_libnuma_reads_back_policy_unknown(tmp_path, monkeypatch):
    from sglang.srt.placement import libnuma

    monkeypatch.setattr(libnuma, "load_libnuma", lambda: None)
    with pytest.raises(OSError) as raised:
        libnuma.read_mempolicy()
    assert raised.value.errno == errno.ENOSYS
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "status").write_text(
        "Cpus_allowed_list:\t0-1\nMems_allowed_list:\t0\n"
    )
    crafted(monkeypatch, tmp_path, policy=None)
    obs = observe_self()
    assert (obs.cpus, obs.policy, obs.policy_nodes) == ({0, 1}, "unknown", set())
    assert ObservedBinding.from_dict(obs.to_dict()) == obs


def test_a_status_without_the_cpu_list_is_an_error_naming_the_file(
    tmp_path, monkeypatch
):
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "status").write_text("Mems_allowed_list:\t0\n")
    crafted(monkeypatch, tmp_path)
    with pytest.raises(PlacementError, match="status: has no Cpus_allowed_list line"):
        observe_self()


# -- compare ----------------------------------------------------------------------------------


def test_compare_matching_binding_is_empty():
    assert compare_binding(placement(), observed()) == []


def test_compare_reports_each_difference_on_one_line():
    diffs = compare_binding(
        placement(),
        observed(
            cpus=frozenset({0, 1, 2, 3}), policy="default", policy_nodes=frozenset()
        ),
    )
    assert diffs == [
        "cpus 0-3 observed, 2-3 planned",
        "memory policy default observed, bind on node(s) 1 planned",
    ]


def test_compare_reports_bind_where_preferred_was_planned():
    diffs = compare_binding(placement(mem_policy="preferred"), observed())
    assert diffs == [
        "memory policy bind on node(s) 1 observed, preferred on node(s) 1 planned"
    ]


def test_compare_reports_wrong_bind_nodes_and_missing_mems():
    diffs = compare_binding(
        placement(), observed(mems=frozenset({0}), policy_nodes=frozenset({0}))
    )
    assert diffs == [
        "mems allowed 0 observed, must include 1 (a cpuset or an outer numactl restricts this process)",
        "memory policy bind on node(s) 0 observed, bind on node(s) 1 planned",
    ]


def test_compare_checks_only_cpus_when_memory_is_not_planned():
    plan = placement(mem_policy="none", mem_nodes=frozenset())
    assert (
        compare_binding(plan, observed(policy="default", policy_nodes=frozenset()))
        == []
    )
    assert compare_binding(plan, observed(cpus=frozenset({0}))) == [
        "cpus 0 observed, 2-3 planned"
    ]


def test_compare_checks_nothing_for_an_unbound_placement():
    plan = placement(strategy="none")
    assert (
        compare_binding(
            plan,
            observed(cpus=frozenset({0}), policy="default", policy_nodes=frozenset()),
        )
        == []
    )
