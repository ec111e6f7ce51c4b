"""Shared-memory owner records under attack and load: foreign directories and segments, dead owners of any namespace, name lengths, ports, file:// paths, escaped errors.

Real /dev/shm (a private directory per test), real flock, real processes killed with
SIGKILL, real uids (tests that need another uid fail when not run as root).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import random
import shutil
import signal
import stat
import sys
import tempfile

import pytest
import shm_children

from sglang.srt.distributed.shm_namespace import (
    NAME_MAX,
    ShmNamespace,
    ShmNamespaceError,
    parse_port,
)
from sglang.srt.distributed.shm_segments import (
    claim_segment,
    release_shm_collective,
    remove_stale_segments,
)

sys.path.insert(
    0,
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"
    ),
)

import shm_stress  # noqa: E402

SHM = "/dev/shm"
UID = os.getuid()
_SPAWN = multiprocessing.get_context("spawn")


def _reap_children() -> None:
    while _Child.running:
        child = _Child.running.pop()
        if child.proc.is_alive():
            child.kill()


@pytest.fixture(autouse=True)
def _no_child_outlives_its_test():
    yield
    _reap_children()


@pytest.fixture
def shm_dir():
    """A private stand-in for /dev/shm on the same tmpfs, removed afterwards."""
    path = tempfile.mkdtemp(prefix="sglang-shm-test-", dir=SHM)
    yield path
    _reap_children()
    shutil.rmtree(path, ignore_errors=True)


def _unused_ids() -> tuple[int, int, int]:
    """A victim uid, an attacker uid and a group of both, none known to this host."""
    taken = {line.split(":")[2] for line in open("/etc/passwd") if line.count(":") >= 2}
    while True:
        victim, attacker, gid = (random.randrange(300_000, 400_000) for _ in range(3))
        if victim != attacker and not {str(victim), str(attacker)} & taken:
            return victim, attacker, gid


@pytest.fixture
def sticky_dir():
    """Like /dev/shm (sticky, writable by the users in it) but only for a fresh group of
    two fresh uids, so that nothing is world-writable: ``(dir, victim, attacker, gid)``.
    """
    if os.geteuid() != 0:
        pytest.fail(
            f"this test runs a victim and an attacker as two other uids, which needs root "
            f"(euid is {os.geteuid()}); run it as root, as CI does"
        )
    victim, attacker, gid = _unused_ids()
    path = tempfile.mkdtemp(prefix="sglang-shm-sticky-", dir=SHM)
    os.chown(path, 0, gid)
    os.chmod(path, 0o1770)
    yield path, victim, attacker, gid
    _reap_children()
    shutil.rmtree(path, ignore_errors=True)


class _Child:
    """A spawned process running one body of ``shm_children`` as ``uid`` (None: this uid).

    Daemonic, and SIGKILLed after each test if still alive, so that a failed test
    never leaves a holder waiting for a word that will not come.
    """

    running: list["_Child"] = []

    def __init__(self, uid, gid, body: str, *args) -> None:
        self.conn, child_end = _SPAWN.Pipe()
        self.proc = _SPAWN.Process(
            target=shm_children.run_as,
            args=(uid, gid, child_end, body, *args),
            daemon=True,
        )
        self.proc.start()
        child_end.close()
        _Child.running.append(self)

    def recv(self, timeout: float = 60.0):
        assert self.conn.poll(
            timeout
        ), f"child {self.proc.pid} said nothing in {timeout} s"
        return self.conn.recv()

    def claimed(self) -> dict:
        message = self.recv()
        assert message[0] == "claimed", f"claim failed: {message}"
        return message[1]

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(30)

    def finish(self):
        self.conn.send("release")
        assert self.recv()[0] == "ok"
        self.proc.join(30)
        assert self.proc.exitcode == 0


def _run(uid, gid, body: str, *args):
    child = _Child(uid, gid, body, *args)
    try:
        return child.recv()
    finally:
        child.proc.join(30)


def _records(shm_dir: str, segment: str) -> list[str]:
    """Every owner record of ``segment`` anywhere under ``shm_dir``."""
    found = []
    for root, _dirs, files in os.walk(shm_dir):
        found += [os.path.join(root, f) for f in files if f == segment + ".owner"]
    return found


# ------------------------------------------------------ another user's directory or segment


@pytest.mark.parametrize("kind", ["dir", "dir0770", "symlink", "file"])
def test_another_users_owner_directory_blocks_no_claim(sticky_dir, kind):
    shared, victim, attacker, gid = sticky_dir
    squatted = os.path.join(shared, f"sglang_shm_owners_{victim}")
    assert _run(attacker, gid, "plant", squatted, kind)[0] == "ok"
    port = 41001
    segment = ShmNamespace(addr="127.0.0.1", port=port, uid=victim).segment_name(0)

    holder = _Child(victim, gid, "claim", shared, port, 0, True)
    try:
        info = holder.claimed()
        # Another process of the same user finds the holder's record in the private directory.
        outcome = _run(victim, gid, "claim", shared, port, 0, False)
        assert outcome[:2] == ("error", "ShmCollectiveError"), outcome
        assert f"pid {info['pid']}" in outcome[2]
        warnings = [line for line in outcome[3] if line.startswith("WARNING")]
        assert any(
            repr(squatted) in line and f"uid {attacker}" in line for line in warnings
        ), warnings
        [record] = _records(shared, segment)
        private = os.path.dirname(record)
        assert private != squatted and os.path.dirname(private) == shared
        held = os.lstat(private)
        assert stat.S_ISDIR(held.st_mode) and held.st_uid == victim
        assert stat.S_IMODE(held.st_mode) == 0o700
        assert os.lstat(squatted).st_uid == attacker
    finally:
        holder.kill()
    # The holder is dead: a later claim of the same user removes what it left.
    assert _run(victim, gid, "claim", shared, port, 1, False)[0] == "ok"
    assert not os.path.exists(info["segment"]) and _records(shared, segment) == []


def test_segment_planted_by_another_user_is_refused_naming_file_owner_and_fix(
    sticky_dir,
):
    shared, victim, attacker, gid = sticky_dir
    port = 41002
    planted = os.path.join(
        shared, ShmNamespace(addr="127.0.0.1", port=port, uid=victim).segment_name(0)
    )
    assert _run(attacker, gid, "plant", planted, "file")[0] == "ok"
    outcome = _run(victim, gid, "claim", shared, port, 0, False)
    assert outcome[:2] == ("error", "ShmCollectiveError"), outcome
    message = outcome[2].splitlines()[0]
    assert repr(planted) in message and f"uid {attacker}" in message
    assert "remove it" in message and "--dist-init-addr" in message
    # The refused claim kept no record: once the file is gone the claim succeeds.
    os.unlink(planted)
    assert _run(victim, gid, "claim", shared, port, 0, False)[0] == "ok"
    assert not os.path.exists(planted)


def test_owners_in_two_private_directories_still_exclude_each_other(shm_dir):
    usual = os.path.join(shm_dir, f"sglang_shm_owners_{UID}")
    os.mkdir(usual, 0o700)
    os.chmod(usual, 0o750)
    first = _Child(None, None, "claim", shm_dir, 41004, 0, True)
    first_info = first.claimed()
    segment = os.path.basename(first_info["segment"])
    [first_record] = _records(shm_dir, segment)
    assert os.path.dirname(first_record).startswith(usual + ".")
    # The usual directory becomes usable again, so the next claimant records there.
    os.rmdir(usual)
    try:
        outcome = _run(None, None, "claim", shm_dir, 41004, 0, False)
        assert outcome[:2] == ("error", "ShmCollectiveError"), outcome
        assert f"pid {first_info['pid']}" in outcome[2]
    finally:
        first.kill()
    assert _run(None, None, "claim", shm_dir, 41004, 0, False)[0] == "ok"
    # The dead owner's record and its private directory went with the takeover.
    assert not os.path.exists(os.path.dirname(first_record))
    assert os.listdir(shm_dir) == []


def test_dead_record_beside_a_live_owner_never_removes_its_segment(shm_dir):
    live = _Child(None, None, "claim", shm_dir, 41005, 0, True)
    info = live.claimed()
    segment = os.path.basename(info["segment"])
    # What a claimant killed while backing off leaves: an unlocked record elsewhere.
    orphan_dir = tempfile.mkdtemp(prefix=f"sglang_shm_owners_{UID}.", dir=shm_dir)
    orphan = os.path.join(orphan_dir, segment + ".owner")
    os.close(os.open(orphan, os.O_CREAT | os.O_RDWR, 0o600))
    sweep = remove_stale_segments(
        ShmNamespace(addr="127.0.0.1", port=41005), shm_dir=shm_dir
    )
    assert sweep.live == (segment,) and sweep.removed == ()
    with open(info["segment"], "rb") as f:
        assert f.read() == f"pid {info['pid']} rank 0\n".encode()
    live.finish()
    remove_stale_segments(ShmNamespace(addr="127.0.0.1", port=41005), shm_dir=shm_dir)
    assert os.listdir(shm_dir) == []


def test_a_dead_engines_helper_that_kept_the_lock_is_named_with_its_command(shm_dir):
    engine = _Child(None, None, "claim_with_helper", shm_dir, 41006, 0)
    info = engine.claimed()
    helper = info["helper"]
    try:
        engine.kill()  # SIGKILL: the forked helper lives on, holding the record's lock
        outcome = _run(None, None, "claim", shm_dir, 41006, 0, False)
        assert outcome[:2] == ("error", "ShmCollectiveError"), outcome
        message = outcome[2].splitlines()[0]
        assert f"was made by pid {info['pid']}, which no longer holds it" in message
        assert f"locked by pid {helper}: {shm_children.HELPER_TITLE!r}" in message
        assert f"kill {helper}" in message and "--dist-init-addr" in message
        assert "live process" not in message
    finally:
        os.kill(helper, signal.SIGKILL)
    # Once the helper is gone its lock goes with it: the next claim takes over.
    outcome = _run(None, None, "claim", shm_dir, 41006, 0, False, 30.0)
    assert outcome[0] == "ok", outcome
    assert outcome[1]["pid"] != info["pid"]
    # It removed the dead engine's segment and record; its own went when it exited.
    assert os.listdir(shm_dir) == []


# ----------------------------------------------------------- dead owners of other namespaces


def _killed_tp2_engine(shm_dir: str, port: int) -> list[str]:
    """Two claimers of ``port`` (a TP 2 engine), SIGKILLed; their segments' paths."""
    ranks = [_Child(None, None, "claim", shm_dir, port, rank, True) for rank in (0, 1)]
    segments = [child.claimed()["segment"] for child in ranks]
    for child in ranks:
        child.kill()
    assert all(os.path.exists(s) for s in segments)
    return segments


def test_another_engines_claim_removes_dead_owners_of_every_namespace(shm_dir):
    live = _Child(None, None, "claim", shm_dir, 41003, 0, True)
    live_info = live.claimed()
    dead = _killed_tp2_engine(shm_dir, 41001)
    assert _run(None, None, "claim", shm_dir, 41002, 0, False)[0] == "ok"
    for segment in dead:
        assert not os.path.exists(segment)
        assert _records(shm_dir, os.path.basename(segment)) == []
    with open(live_info["segment"], "rb") as f:
        assert f.read() == f"pid {live_info['pid']} rank 0\n".encode()
    assert len(_records(shm_dir, os.path.basename(live_info["segment"]))) == 1
    live.finish()
    assert os.listdir(shm_dir) == []


def test_sweep_reports_dead_owners_of_other_namespaces_and_keeps_live_ones(shm_dir):
    live = _Child(None, None, "claim", shm_dir, 41003, 0, True)
    live_info = live.claimed()
    dead = _killed_tp2_engine(shm_dir, 41001)
    sweep = remove_stale_segments(
        ShmNamespace(addr="127.0.0.1", port=41002), shm_dir=shm_dir
    )
    assert sorted(sweep.removed) == sorted(os.path.basename(s) for s in dead)
    assert os.path.basename(live_info["segment"]) not in sweep.removed
    assert os.path.exists(live_info["segment"])
    assert sorted(os.listdir(shm_dir)) == sorted(
        [os.path.basename(live_info["segment"]), f"sglang_shm_owners_{UID}"]
    )
    live.finish()


# ----------------------------------------------------------------------------------- load


def test_stress_claims_releases_and_kills_never_touch_a_live_segment(shm_dir):
    result = shm_stress.run(processes=4, seconds=5.0, shm_dir=shm_dir, seed=1)
    # Enough traffic to mean something on a loaded 2-core host; the figures belong to the benchmark.
    assert result.claims >= 10, result
    assert result.owners_killed >= 1, result
    assert result.live_touched == 0, result
    assert result.leftovers == (), result


# ------------------------------------------------------------------------------ name length


def test_longest_accepted_host_claims_and_one_more_character_is_rejected(shm_dir):
    fixed = len(f"deepspeed_allreduce_buffer_{UID}__65535_99999.owner")
    longest = "h" * (NAME_MAX - fixed)
    ns = ShmNamespace(addr=longest, port=65535)
    assert ShmNamespace.from_init_method(f"tcp://{longest}:65535") == ns
    claim_segment(ns, rank=99999, shm_dir=shm_dir, wait_s=0)
    segment = os.path.join(shm_dir, ns.segment_name(99999))
    os.close(os.open(segment, os.O_CREAT | os.O_RDWR, 0o600))
    assert len(_records(shm_dir, ns.segment_name(99999))) == 1
    assert release_shm_collective(ns) == [ns.segment_name(99999)]
    assert not os.path.exists(segment)
    for make in (
        lambda: ShmNamespace(addr=longest + "h", port=65535),
        lambda: ShmNamespace.from_init_method(f"tcp://{longest}h:65535"),
        lambda: dataclasses.replace(ns, pp_rank=1),
    ):
        with pytest.raises(ShmNamespaceError, match="too long.*--dist-init-addr"):
            make()


# -------------------------------------------------------------------------------------- port


@pytest.mark.parametrize(
    "port_text", ["²", "٨٠", "1²", "\x00", "8\x0b0", "+80", "8_0", "0x50", "-1"]
)
def test_port_must_be_ascii_digits_and_the_error_shows_the_value(port_text):
    method = f"tcp://127.0.0.1:{port_text}"
    with pytest.raises(ShmNamespaceError) as info:
        ShmNamespace.from_init_method(method)
    message = str(info.value)
    assert message.startswith(f"dist_init_method={method!r}: ")
    assert repr(port_text)[1:-1] in message.partition(": ")[2]
    assert message.isprintable()
    with pytest.raises(ShmNamespaceError) as info:
        ShmNamespace.from_init_method(
            "env://", environ={"MASTER_ADDR": "h", "MASTER_PORT": port_text}
        )
    assert "MASTER_PORT" in str(info.value) and repr(port_text) in str(info.value)


def test_port_digit_count_is_bounded_before_conversion():
    with pytest.raises(ShmNamespaceError, match="out of range"):
        parse_port("9" * 5000, what="MASTER_PORT")
    assert parse_port("029500", what="x") == 29500


# ---------------------------------------------------------------------------------- file://


def test_file_init_method_uses_torchs_path_whatever_the_working_directory(
    tmp_path, monkeypatch
):
    import torch.distributed as dist

    method = f"file://ignored{tmp_path}/store"
    store, _rank, _world = next(dist.rendezvous(method + "?rank=0&world_size=1"))
    # torch drops the netloc: the store is tmp_path/store, not ./ignored/...
    assert (tmp_path / "store").exists() and not (tmp_path / "ignored").exists()
    del store
    seen = []
    for cwd in ("a", "b"):
        (tmp_path / cwd).mkdir()
        monkeypatch.chdir(tmp_path / cwd)
        seen.append(
            (
                ShmNamespace.from_init_method(method),
                ShmNamespace.from_init_method("file://tmp/x"),
            )
        )
    assert seen[0] == seen[1]
    assert seen[0][0] == ShmNamespace.from_init_method(
        f"file://{tmp_path}/store?rank=1&world_size=2"
    )
    assert seen[0][1] == ShmNamespace.from_init_method("file:///x")
    assert seen[0][0] != seen[0][1]
    with pytest.raises(ShmNamespaceError, match="names no file"):
        ShmNamespace.from_init_method("file://tmp")


# ------------------------------------------------------------------------ escaped messages


@pytest.mark.parametrize(
    "call",
    [
        lambda: ShmNamespace.from_init_method("tcp://fe80::1%\n\x00:1"),
        lambda: ShmNamespace.from_init_method("tcp://[fe80::1%\x00]"),
        lambda: ShmNamespace.from_init_method("tcp://[fe80::1%\x1b]x"),
        lambda: ShmNamespace.from_init_method("tcp://h\x00:8\n0"),
        lambda: ShmNamespace.from_init_method("tcp://h\x00:1\x7f"),
        lambda: ShmNamespace.from_init_method("tcp://h:" + "9" * 250),
        lambda: ShmNamespace.from_init_method("tcp://h\x00:1"),
        lambda: ShmNamespace.from_init_method("bad\x00://x"),
        lambda: ShmNamespace.from_init_method(
            "env://", environ={"MASTER_ADDR": "a\u2028b", "MASTER_PORT": "1"}
        ),
        lambda: ShmNamespace.from_init_method(
            "env://", environ={"MASTER_ADDR": "", "MASTER_PORT": "\x00"}
        ),
        lambda: ShmNamespace(addr="\n", port=1),
    ],
)
def test_outside_values_in_errors_are_escaped(call):
    with pytest.raises(ValueError) as info:
        call()
    assert str(info.value).isprintable(), str(info.value)
