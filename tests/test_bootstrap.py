"""ShmNamespace, init_shm_collective, and segments left by a set-up that died.

The kernel is the torch.library stand-in of ``shm_kernel_standin`` (real /dev/shm
segments); other engines are real processes, killed for real. Bootstrap's whole
CPU path, in real ranks, is in test_bootstrap_engines.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import stat
import subprocess
import sys

import pytest
import shm_kernel_standin as kernel
import torch

from sglang.srt.distributed.shm_collective import (
    ShmCollectiveError,
    ShmNamespace,
    init_shm_collective,
    join_shm_group,
    shm_group_timeout,
    start_shm_collective,
    unlink_shm_segments,
)
from sglang.srt.distributed.shm_namespace import NAME_MAX
from sglang.srt.utils.network import NetworkAddress

SHM = "/dev/shm"
HERE = os.path.dirname(os.path.abspath(__file__))
UID = os.getuid()


def _unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def namespace():
    """A namespace no other test or engine uses; its files are removed afterwards."""
    ns = ShmNamespace(addr="127.0.0.1", port=_unused_port())
    yield ns
    unlink_shm_segments()
    _remove_namespace_files(ns)


@pytest.fixture
def master_env(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.9.9.9")
    monkeypatch.setenv("MASTER_PORT", "29999")
    monkeypatch.setenv("LOCAL_SIZE", "7")
    return {"MASTER_ADDR": "10.9.9.9", "MASTER_PORT": "29999", "LOCAL_SIZE": "7"}


# ------------------------------------------------------------------------------ namespace


def test_segment_name_matches_cpu_kernel_format():
    ns = ShmNamespace.from_init_method("tcp://127.0.0.1:29500")
    assert ns == ShmNamespace(addr="127.0.0.1", port=29500, uid=UID)
    assert ns.segment_name(3) == f"deepspeed_allreduce_buffer_{UID}_127.0.0.1_29500_3"
    assert ns.prefix + "_3" == ns.segment_name(3)


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29600"},
        {"MASTER_ADDR": "0.0.0.0", "MASTER_PORT": "1"},
    ],
)
def test_two_addresses_never_share_a_segment_whatever_the_environment(monkeypatch, env):
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    before = dict(os.environ)
    a = ShmNamespace.from_init_method("tcp://127.0.0.1:29500")
    b = ShmNamespace.from_init_method("tcp://127.0.0.1:29600")
    names_a = {a.segment_name(r) for r in range(64)}
    names_b = {b.segment_name(r) for r in range(64)}
    assert not names_a & names_b
    assert all("_29500_" in n for n in names_a) and all("_29600_" in n for n in names_b)
    assert dict(os.environ) == before


def test_ipv6_and_stages():
    ns = ShmNamespace.from_init_method("tcp://[::1]:29500")
    assert (ns.addr, ns.port) == ("::1", 29500)
    assert ns.segment_name(0) == f"deepspeed_allreduce_buffer_{UID}_::1_29500_0"
    stage1 = ShmNamespace.from_init_method("tcp://[::1]:29500", pp_rank=1)
    assert stage1.segment_name(0) == f"deepspeed_allreduce_buffer_{UID}_::1@pp1_29500_0"
    assert ShmNamespace.from_init_method("tcp://[::1]:29500", pp_rank=0) == ns
    assert not stage1.segment_name(0).startswith(ns.prefix + "_")


@pytest.mark.parametrize(
    "method, needle",
    [
        # Upstream's NetworkAddress splits host:port; its messages, then ours.
        ("tcp://127.0.0.1", "Missing port"),
        ("tcp://127.0.0.1:", "Invalid port number: ''"),
        ("tcp://127.0.0.1:port", "Invalid port number: 'port'"),
        ("tcp://127.0.0.1:0", "expected 1 to 65535"),
        ("tcp://127.0.0.1:65536", "Port out of range"),
        ("tcp://[::1]", "Expected ':port' after closing bracket"),
        ("tcp://[::1:29500", "Missing closing bracket"),
        ("tcp://::1:29500", "Bare IPv6 address without brackets"),
        ("tcp://h:1:29500", "write an IPv6 host as"),
        ("tcp://[example.com]:29500", "Invalid IPv6 address inside brackets"),
        ("tcp://:29500", "Empty host"),
        ("tcp://127.0.0.1:+80", "expected 1 to 65535"),
        ("tcp://a/b:29500", "letters, digits and . _ - : %"),
        ("tcp://" + "h" * 220 + ":29500", "too long"),
        ("tcp://" + "h" * 300 + ":29500", "too long"),
        ("tcp://bad$host:29500", "letters, digits and"),
        ("tcp://host@x:29500", "letters, digits and"),
        ("http://host:29500", "expected 'tcp://host:port'"),
        ("127.0.0.1:29500", "expected 'tcp://host:port'"),
        ("", "expected 'tcp://host:port'"),
        ("file://", "names no file"),
    ],
)
def test_malformed_init_methods_get_clear_errors(method, needle):
    with pytest.raises(ShmCollectiveError) as info:
        ShmNamespace.from_init_method(method)
    assert needle in str(info.value)
    assert "dist_init_method" in str(info.value)


def test_env_init_method_reads_master_variables_without_writing_them(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.5")
    monkeypatch.setenv("MASTER_PORT", "4000")
    before = dict(os.environ)
    ns = ShmNamespace.from_init_method("env://")
    assert (ns.addr, ns.port) == ("10.0.0.5", 4000)
    assert dict(os.environ) == before
    monkeypatch.setenv("MASTER_ADDR", "[::1]")
    assert ShmNamespace.from_init_method("env://").addr == "::1"
    monkeypatch.setenv("MASTER_PORT", "x")
    with pytest.raises(ShmCollectiveError, match="MASTER_PORT"):
        ShmNamespace.from_init_method("env://")
    monkeypatch.delenv("MASTER_PORT")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.5")
    with pytest.raises(ShmCollectiveError, match="set MASTER_ADDR and MASTER_PORT"):
        ShmNamespace.from_init_method("env://")


def test_file_init_method_falls_back_to_a_path_digest(tmp_path):
    a = ShmNamespace.from_init_method(f"file://{tmp_path}/a")
    again = ShmNamespace.from_init_method(f"file://{tmp_path}/a")
    b = ShmNamespace.from_init_method(f"file://{tmp_path}/b")
    assert a == again and a != b
    assert a.port == 0 and a.addr.startswith("file.") and len(a.addr) == 21
    assert a.segment_name(0) != b.segment_name(0)


def test_name_max_bounds_the_longest_segment_name():
    fixed = len(f"deepspeed_allreduce_buffer_{UID}__65535_99999")
    longest_ok = "h" * (NAME_MAX - fixed)
    ns = ShmNamespace(addr=longest_ok, port=65535)
    assert len(ns.segment_name(99999)) == NAME_MAX
    with pytest.raises(ShmCollectiveError, match="too long"):
        ShmNamespace(addr=longest_ok + "h", port=65535)
    with pytest.raises(ShmCollectiveError, match="rank=100000"):
        ns.segment_name(100000)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"addr": "", "port": 1}, "expected a host name"),
        ({"addr": "h", "port": -1}, "port=-1"),
        ({"addr": "h", "port": 70000}, "port=70000"),
        ({"addr": "h", "port": "1"}, "port='1'"),
        ({"addr": "h", "port": 1, "uid": -1}, "uid=-1"),
        ({"addr": "h", "port": 1, "pp_rank": -1}, "pp_rank=-1"),
        ({"addr": "a b", "port": 1}, "letters, digits"),
    ],
)
def test_explicit_construction_is_validated(kwargs, needle):
    with pytest.raises(ShmCollectiveError) as info:
        ShmNamespace(**kwargs)
    assert needle in str(info.value)


def test_namespace_is_frozen():
    ns = ShmNamespace(addr="h", port=1)
    with pytest.raises(AttributeError):
        ns.port = 2


# ------------------------------------------- init methods as upstream's bootstrap makes them


@pytest.mark.parametrize(
    "dist_init_addr, expected",
    [
        ("127.0.0.1:29500", ("127.0.0.1", 29500)),
        ("node-1.example:5", ("node-1.example", 5)),
        ("[::1]:29500", ("::1", 29500)),
        ("[fe80::1%eth0]:7", ("fe80::1%eth0", 7)),
    ],
)
def test_upstreams_init_methods_name_the_same_address(dist_init_addr, expected):
    # bootstrap._resolve_dist_init_method: NetworkAddress.parse(addr).to_tcp(), or
    # NetworkAddress(host, dist_port).to_tcp() without --dist-init-addr.
    for method in (
        NetworkAddress.parse(dist_init_addr).to_tcp(),
        NetworkAddress(*expected).to_tcp(),
        NetworkAddress(*expected).to_tcp() + "/?world_size=2",
    ):
        ns = ShmNamespace.from_init_method(method)
        assert (ns.addr, ns.port) == expected
        assert NetworkAddress(ns.addr, ns.port).to_host_port_str() == dist_init_addr


# -------------------------------------------------------------------- init_shm_collective


def test_a_kernel_with_groups_is_joined_once_the_tp_group_exists(namespace):
    """start_shm_collective only notes the stage: the nonce comes over the TP group."""
    from sglang.srt.distributed import shm_collective

    with kernel.registered("group") as calls:
        method = f"tcp://127.0.0.1:{namespace.port}"
        start_shm_collective(dist_init_method=method, tp_size=2, tp_rank=1, pp_rank=0)
        assert calls == [] and unlink_shm_segments() == []
        [(pid, noted, size, rank)] = shm_collective._GROUPS
        assert (pid, noted, size, rank) == (os.getpid(), namespace, 2, 1)
        shm_collective._GROUPS.clear()


@pytest.mark.parametrize(
    "dist_timeout, seconds", [(None, 1800.0), (30, 30.0), (10**9, 7 * 24 * 3600.0)]
)
def test_the_group_deadline_is_the_engines_dist_timeout(dist_timeout, seconds):
    assert shm_group_timeout(dist_timeout) == seconds


def test_released_schema_sees_namespace_only_during_the_call(namespace, master_env):
    with kernel.registered("released") as calls:
        init_shm_collective(namespace, tp_size=1, tp_rank=0)
        assert {k: os.environ[k] for k in master_env} == master_env
        assert {k: kernel.c_getenv(k) for k in master_env} == master_env
        [call] = calls
        assert call["env"] == {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(namespace.port),
            "LOCAL_SIZE": "1",
        }
        segment = os.path.join(SHM, namespace.segment_name(0))
        assert call["segment"] == namespace.segment_name(0)
        assert stat.S_IMODE(os.stat(segment).st_mode) == 0o600
        assert kernel.peer_prefixes() == {0: namespace.prefix}
        # No other file: no owner record, no directory.
        assert [n for n in os.listdir(SHM) if "sglang_shm_owners" in n] == []
        assert unlink_shm_segments() == [segment]
        assert not os.path.exists(segment)
        # The kernel's mapping outlives the name.
        assert kernel.peer_prefixes() == {0: namespace.prefix}


def test_released_schema_restores_absent_variables(namespace, monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    before = dict(os.environ)
    with kernel.registered("released") as calls:
        init_shm_collective(namespace, tp_size=1, tp_rank=0)
        assert calls[0]["env"]["MASTER_PORT"] == str(namespace.port)
    assert dict(os.environ) == before
    assert all(
        kernel.c_getenv(n) is None for n in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE")
    )


def test_released_schema_restores_environment_on_error(namespace, master_env):
    with kernel.registered("released") as calls:
        kernel.FAIL_NEXT.append(RuntimeError("kernel failed"))
        with pytest.raises(RuntimeError, match="kernel failed"):
            init_shm_collective(namespace, tp_size=1, tp_rank=0)
        assert calls[0]["env"]["MASTER_ADDR"] == "127.0.0.1"
        assert {k: os.environ[k] for k in master_env} == master_env
        assert {k: kernel.c_getenv(k) for k in master_env} == master_env
        # The failed rank left its name for peers that wait for it; a retry reuses it.
        assert os.path.exists(os.path.join(SHM, namespace.segment_name(0)))
        assert unlink_shm_segments() == []
        init_shm_collective(namespace, tp_size=1, tp_rank=0)


def test_a_group_gets_its_own_names_and_no_environment(namespace, master_env):
    stage = dataclasses.replace(namespace, pp_rank=2)
    name = f"{stage.group_namespace}_g1_0"
    with kernel.registered("group") as calls:
        join_shm_group(stage, tp_size=1, tp_rank=0, group="g1", timeout=5.0)
        [call] = calls
        assert (call["segment"], call["group"], call["timeout"]) == (name, "g1", 5.0)
        assert call["env"] == master_env
        # Never a released kernel's name, and never longer than the longest of them.
        assert not name.startswith("deepspeed_allreduce_buffer_")
        assert len(f"{stage.group_namespace}_{'f' * 16}") <= len(stage.prefix)
        # The kernel made, then unlinked, its segment; this side did nothing.
        assert kernel.peer_prefixes() == {0: f"{stage.group_namespace}_g1"}
        assert not os.path.exists(os.path.join(SHM, name))
        assert unlink_shm_segments() == []


def test_a_group_refuses_a_file_under_its_name(namespace):
    planted = os.path.join(SHM, f"{namespace.group_namespace}_g1_0")
    os.close(os.open(planted, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    try:
        with kernel.registered("group"):
            with pytest.raises(RuntimeError, match=f"{planted} exists"):
                join_shm_group(namespace, tp_size=1, tp_rank=0, group="g1", timeout=5)
        assert os.path.getsize(planted) == 0
    finally:
        os.unlink(planted)


@pytest.mark.parametrize("tp_size, tp_rank", [(0, 0), (2, 2), (2, -1), (True, 0)])
def test_bad_ranks_are_refused(namespace, tp_size, tp_rank):
    with pytest.raises(ShmCollectiveError, match="tp_rank|tp_size"):
        init_shm_collective(namespace, tp_size=tp_size, tp_rank=tp_rank)


# ------------------------------------------------------------------------ stale segments


class _Holder:
    """A real process that initialises one rank and keeps its segment."""

    def __init__(
        self, schema: str, ns: ShmNamespace, tp_size: int, tp_rank: int
    ) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                os.path.join(HERE, "bootstrap_children.py"),
                "hold",
                schema,
                ns.addr,
                str(ns.port),
                str(tp_size),
                str(tp_rank),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline().strip()
        assert line == "ready", f"holder said {line!r}"

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


def _remove_namespace_files(ns: ShmNamespace) -> None:
    for name in os.listdir(SHM):
        if name.startswith(ns.prefix + "_"):
            os.unlink(os.path.join(SHM, name))


def test_rank_killed_in_initialize_leaves_its_segment_which_the_next_one_reuses(
    namespace, caplog
):
    # Killed mid set-up: rank 1 of a TP 2 engine, in the kernel's open loop for rank 0.
    killed = _Holder("released", namespace, 2, 1)
    killed.kill()
    assert sorted(n for n in os.listdir(SHM) if namespace.prefix in n) == [
        namespace.segment_name(1)
    ]
    segment = os.path.join(SHM, namespace.segment_name(1))
    left = os.stat(segment).st_ino
    # The next engine on that address: its rank 0 first, then its rank 1 (here).
    peer = _Holder("released", namespace, 2, 0)
    try:
        with kernel.registered("released") as calls:
            init_shm_collective(namespace, tp_size=2, tp_rank=1)
            # The kernel reused the file (O_CREAT, no O_EXCL): whoever opened the
            # name before this rank came maps the very file this rank writes.
            assert os.stat(segment).st_ino == left
            assert calls[0]["segment"] == namespace.segment_name(1)
            assert kernel.peer_prefixes() == {0: namespace.prefix, 1: namespace.prefix}
            assert unlink_shm_segments() == [segment]
    finally:
        peer.stop()
    assert not os.path.exists(segment)


@pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root, to chown a file to another uid"
)
@pytest.mark.parametrize("rank", [0, 1])
def test_another_users_segment_is_refused_and_nothing_is_mapped(namespace, rank):
    """A file another uid made under the engine's name, for this rank or a peer."""
    planted = os.path.join(SHM, namespace.segment_name(rank))
    fd = os.open(planted, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666)
    os.close(fd)
    os.chown(planted, 54321, 54321)
    with kernel.registered("released") as calls:
        with pytest.raises(ShmCollectiveError) as info:
            init_shm_collective(namespace, tp_size=2, tp_rank=0)
        assert calls == [] and kernel.peer_prefixes() == {}
    message = str(info.value)
    assert message.startswith(f"rank 0: {planted!r} is owned by uid 54321")
    assert "Have uid 54321 (or root) remove it" in message
    assert "--dist-init-addr" in message
    # Nothing of this rank's is left, and the planted file is untouched.
    assert sorted(n for n in os.listdir(SHM) if namespace.prefix in n) == [
        namespace.segment_name(rank)
    ]
    assert os.stat(planted).st_uid == 54321


def test_finish_without_a_segment_needs_no_group_and_does_nothing():
    """GPU ranks, and CPU hosts without the kernel, pass bootstrap's call unharmed."""
    from sglang.srt.distributed.parallel_state import model_parallel_is_initialized
    from sglang.srt.distributed.shm_collective import finish_shm_collective

    assert not model_parallel_is_initialized()
    assert finish_shm_collective() == []
