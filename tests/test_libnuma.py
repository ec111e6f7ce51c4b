"""The ctypes libnuma binding against the real libnuma.so.1 on this host.

Calls that change the memory policy or CPU affinity run in a child process so
the test process is left as it was.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import pytest
from fakelibnuma import FakeLibNuma

from sglang.srt.placement import libnuma as libnuma_mod
from sglang.srt.placement.cpulist import parse_cpulist
from sglang.srt.placement.libnuma import LibNuma, load_libnuma


def _sys_nodes() -> frozenset[int]:
    with open("/sys/devices/system/node/online") as f:
        return parse_cpulist(f.read())


def _node_of_cpu0() -> int:
    for node in _sys_nodes():
        with open(f"/sys/devices/system/node/node{node}/cpulist") as f:
            if 0 in parse_cpulist(f.read()):
                return node
    raise AssertionError("cpu 0 belongs to no node in sysfs")


def _run_child(code: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_real_libnuma_loads_once_and_reports_this_host():
    lib = load_libnuma()
    assert lib is not None, "libnuma.so.1 must be installed (Debian package libnuma1)"
    assert lib is load_libnuma()
    assert isinstance(lib, LibNuma)


def test_missing_library_gives_none_and_one_log_line(caplog, monkeypatch):
    monkeypatch.setattr(libnuma_mod, "LIBRARY", "libnuma-absent.so.9")
    libnuma_mod.load_libnuma.cache_clear()
    try:
        with caplog.at_level(logging.DEBUG, logger=libnuma_mod.__name__):
            assert load_libnuma() is None
            assert load_libnuma() is None
        lines = [r for r in caplog.records if "libnuma-absent.so.9" in r.getMessage()]
        assert len(lines) == 1
    finally:
        libnuma_mod.load_libnuma.cache_clear()


def test_policies_and_migration_through_the_real_library():
    node = _node_of_cpu0()
    absent = max(_sys_nodes()) + 1
    out = _run_child(
        f"""
        import json
        from sglang.srt.placement.libnuma import load_libnuma
        from sglang.srt.placement.libnuma import read_mempolicy
        lib = load_libnuma()
        result = {{}}
        lib.set_preferred({node})
        result["preferred"] = list(read_mempolicy()[0:1]) + sorted(read_mempolicy()[1])
        lib.set_membind([{node}])
        result["bind"] = list(read_mempolicy()[0:1]) + sorted(read_mempolicy()[1])
        result["not_moved"] = lib.move_private_pages(2, [{node}])
        try:
            lib.set_membind([{absent}])
        except OSError as exc:
            result["bind_absent"] = [exc.errno, str(exc)]
        print(json.dumps(result))
        """
    )
    assert out["preferred"] == ["preferred", node]
    assert out["bind"] == ["bind", node]
    assert out["not_moved"] == 0
    assert out["bind_absent"][0] == 22 and "numa_set_membind" in out["bind_absent"][1]


def test_pages_move_in_private_mappings_only():
    """mbind(MPOL_MF_MOVE) goes over the private anonymous mappings: a shared mapping
    (another rank's segment, a library's page cache) keeps its policy and its pages."""
    node = _node_of_cpu0()
    out = _run_child(
        f"""
        import json, mmap
        from sglang.srt.placement.libnuma import MPOL_BIND, load_libnuma
        shared = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_SHARED)
        private = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE)
        shared.write(b"x" * (1 << 20)); private.write(b"y" * (1 << 20))
        refused = load_libnuma().move_private_pages(MPOL_BIND, [{node}])
        lines = open("/proc/self/numa_maps").read().splitlines()
        policy = lambda text: [line.split()[1] for line in lines if text in line]
        print(json.dumps({{"refused": refused, "shared": policy("file=/dev/zero"),
                          "private": policy(" anon=256 "), "heap": policy(" heap ")}}))
        """
    )
    assert out["refused"] == 0
    assert out["heap"] == out["private"] == [f"bind:{node}"], out
    assert out["shared"] == ["default"], out


def test_nodemask_rejects_node_ids_the_kernel_cannot_hold():
    lib = load_libnuma()
    with pytest.raises(OSError, match="outside"):
        lib.move_private_pages(2, [1 << 20])


def test_fake_follows_the_kernel_where_memory_is_missing():
    fake = FakeLibNuma(node_cpus={0: (0, 1), 1: (2, 3), 2: ()}, memory_nodes={0, 1})
    with pytest.raises(OSError) as info:
        fake.set_membind([2])
    assert info.value.errno == 22
    fake.set_membind([1, 2])
    assert (fake.policy, fake.policy_nodes) == ("bind", {1})
    fake.pages.update({0: 100, 1: 5})
    fake.unmovable_pages = 3
    assert fake.move_private_pages(2, [1]) == 3
    assert fake.pages == {0: 3, 1: 102}
    with pytest.raises(OSError):
        fake.move_private_pages(2, [2])
    assert [name for name, _ in fake.calls] == [
        "set_membind",
        "set_membind",
        "move_private_pages",
        "move_private_pages",
    ]
