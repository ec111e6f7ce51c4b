"""The CPU kernel's group set-up (``initialize(size, rank, namespace, group, timeout)``,
upstream_prs' kernel pull requests) with real processes, /dev/shm, flock and kills, on any
x86-64 host, AVX-512 or not.

Each test runs on two builds:

* ``portable``: the patch's own ``shm_group.cpp``, taken from the kernel pull requests'
  ``fix.patch`` files, behind a small C ABI driver (``tests/kernel/shm_group_driver.cpp``,
  a plain sum in place of the collectives), built here with g++. It needs no upstream
  source and no torch, so CI runs it.
* ``kernel``: the kernel's ``interface.cpp``, ``shm.cpp`` and ``shm_group.cpp`` as the
  patches leave them, through ``torch.ops.sgl_kernel``: the build ``SGLANG_CPU_KERNEL``
  names (e.g. the real AVX-512 one), else one made here by ``scripts/build_cpu_kernel.py
  --portable`` from ``SGLANG_UPSTREAM_SOURCE`` (about two minutes). Without either it
  skips, saying so.

``tests/kernel/shm_fault.c`` (LD_PRELOAD) stops a rank at one libc call of the set-up, so
that a test kills it exactly there. Every set-up has a 30 s deadline: a peer that sees a
failure at once fails well within 5 s of it; one that does not waits out the deadline.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import build_cpu_kernel  # noqa: E402

RANK = REPO / "tests" / "shm_group_rank.py"
SOURCES = REPO / "tests" / "kernel"
CPU = "python/sglang/kernels/aot/csrc/cpu"
SHM = Path("/dev/shm")
DEADLINE = 30.0
FAST = 5.0  # a failure seen at once, with room for a loaded host


def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=900, **kwargs)


@pytest.fixture(scope="session")
def builds(tmp_path_factory) -> Path:
    """The driver and the fault library, built from the patches' shm_group.*."""
    if shutil.which("g++") is None or shutil.which("gcc") is None:
        pytest.skip("needs g++ and gcc (apt-get install -y g++) to build shm_group.cpp")
    work = tmp_path_factory.mktemp("shm-group")
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(work.parent)}
    for patch in build_cpu_kernel.PATCHES:
        done = _run(["git", "apply", f"--include={CPU}/shm_group.*", str(patch)],
                    cwd=work, env=env)  # fmt: skip
        assert done.returncode == 0, f"{patch}: {done.stderr}"
    source = work / CPU / "shm_group.cpp"
    assert source.is_file(), "no kernel pull request adds csrc/cpu/shm_group.cpp"
    commands = (
        ["g++", "-std=c++17", "-O2", "-shared", "-fPIC", f"-I{source.parent}",
         str(source), str(SOURCES / "shm_group_driver.cpp"), "-o",
         str(work / "libshmgroup.so")],
        ["gcc", "-O2", "-shared", "-fPIC", str(SOURCES / "shm_fault.c"), "-o",
         str(work / "libshmfault.so"), "-ldl"],
    )  # fmt: skip
    for command in commands:
        done = _run(command)
        assert done.returncode == 0, done.stderr
    return work


def _kernel_library(tmp_path_factory) -> str:
    named = os.environ.get("SGLANG_CPU_KERNEL")
    if named:
        path = Path(named)
        found = sorted(path.glob("common_ops*.so")) if path.is_dir() else [path]
        assert len(found) == 1 and found[0].is_file(), f"SGLANG_CPU_KERNEL={named!r}"
        return str(found[0])
    source = os.environ.get("SGLANG_UPSTREAM_SOURCE")
    if not source:
        pytest.skip(
            "set SGLANG_CPU_KERNEL to a built CPU kernel, or SGLANG_UPSTREAM_SOURCE to "
            "an sglang source tree (built here with --portable), for the kernel build"
        )
    out = tmp_path_factory.mktemp("kernel")
    done = _run([sys.executable, str(REPO / "scripts" / "build_cpu_kernel.py"), source,
                 str(out), "--jobs", "2", "--portable"])  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [library] = out.glob("common_ops*.so")
    return str(library)


@pytest.fixture(scope="session", params=["portable", "kernel"])
def backend(request, builds, tmp_path_factory) -> dict:
    if request.param == "portable":
        return {"backend": "driver", "library": str(builds / "libshmgroup.so")}
    library = _kernel_library(tmp_path_factory)
    probe = ("import sys, torch; torch.ops.load_library(sys.argv[1]); op = "
             "torch.ops.sgl_kernel.initialize; print([str(getattr(op, name)._schema) "
             "for name in op.overloads()])")  # fmt: skip
    schemas = _run([sys.executable, "-c", probe, library]).stdout
    if "str group" not in schemas:
        pytest.skip(f"{library}: initialize takes no group (a released kernel)")
    return {"backend": "kernel", "library": library}


class Ranks:
    """The ranks a test starts, and what they leave in /dev/shm."""

    def __init__(self, backend: dict, fault: Path) -> None:
        self.backend, self.fault = backend, fault
        self.namespace = f"sgltest{os.getpid()}_{secrets.token_hex(3)}"
        self.started: list[subprocess.Popen] = []
        self.children: list[int] = []

    def start(self, size: int, rank: int, group: str, *, stop: str = "",
              value: float = 1.0, **extra) -> subprocess.Popen:  # fmt: skip
        spec = {**self.backend, "size": size, "rank": rank, "group": group,
                "namespace": self.namespace, "timeout": DEADLINE, "value": value,
                **extra}  # fmt: skip
        env = dict(os.environ)
        if stop:
            env.update(LD_PRELOAD=str(self.fault), SHM_FAULT_STOP=stop)
        proc = subprocess.Popen([sys.executable, str(RANK), json.dumps(spec)], env=env,
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
        self.started.append(proc)
        return proc

    def path(self, group: str, rank: int) -> Path:
        return SHM / f"{self.namespace}_{group}_{rank}"

    def wait_for(self, condition, what: str) -> None:
        deadline = time.monotonic() + 120
        while not condition():
            assert time.monotonic() < deadline, f"waited 120 s for {what}"
            time.sleep(0.01)

    def stopped(self, proc: subprocess.Popen) -> None:
        def state() -> str:
            return Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

        self.wait_for(lambda: state() == "T", f"pid {proc.pid} to stop")

    def kill(self, proc: subprocess.Popen) -> float:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        self.children += [int(pid) for pid in children]
        proc.kill()
        proc.wait()
        return time.monotonic()

    def report(self, proc: subprocess.Popen) -> dict:
        out, _ = proc.communicate(timeout=3 * DEADLINE)
        assert proc.returncode == 0, f"rank exited {proc.returncode}: {out}"
        return json.loads(out.strip().splitlines()[-1])

    def left(self) -> list[str]:
        return sorted(p.name for p in SHM.iterdir() if p.name.startswith(self.namespace))

    def tombstones(self) -> list[int]:
        """What a failed set-up leaves: the names of the ranks that came, each shrunk
        to its 4 KiB header, for ranks still to come; the next set-up removes them."""
        return [(SHM / name).stat().st_size for name in self.left()]

    def close(self) -> None:
        for proc in self.started:
            proc.kill()
            proc.wait()
        for pid in self.children:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        for name in self.left():
            (SHM / name).unlink()


@pytest.fixture
def ranks(backend, builds):
    started = Ranks(backend, builds / "libshmfault.so")
    yield started
    started.close()


def error(report: dict) -> str:
    return report["errors"][0] or "returned set up"


def test_groups_sharing_a_namespace_never_pair_and_a_killed_ones_leftovers_go(ranks):
    """Rounds of two concurrent groups in one namespace (a0 and b1 first, which names
    from the namespace alone would pair, under umask 0277), each after a third group
    was killed in set-up: every rank sums its own group's values, only mode 0600 is
    seen, and the killed group's segment is removed by the next set-up."""
    for _ in range(3):
        a, b, killed = (secrets.token_hex(8) for _ in range(3))
        doomed = ranks.start(2, 0, killed)
        ranks.wait_for(ranks.path(killed, 0).exists, "the killed group's segment")
        ranks.kill(doomed)
        first = [ranks.start(2, 0, a, value=1, umask=0o277),
                 ranks.start(2, 1, b, value=20, umask=0o277)]  # fmt: skip
        ranks.wait_for(lambda: ranks.path(a, 0).exists() and ranks.path(b, 1).exists(),
                       "a0 and b1 named")  # fmt: skip
        modes = {ranks.path(g, r).stat().st_mode & 0o777 for g, r in ((a, 0), (b, 1))}
        later = [ranks.start(2, 1, a, value=2), ranks.start(2, 0, b, value=10)]
        reports = [ranks.report(proc) for proc in first + later]
        assert [(r["errors"], r["sum"]) for r in reports] == [
            ([None], 3), ([None], 30), ([None], 3), ([None], 30)
        ]  # fmt: skip
        assert modes == {0o600}
        assert ranks.left() == []


def test_a_rank_killed_once_named_fails_the_ranks_that_come_after(ranks):
    """Table case 1: rank 2 names its segment and is killed before ranks 0 and 1 call
    initialize; the set-up's reclaim must not take its name from its own group."""
    group = secrets.token_hex(8)
    doomed = ranks.start(3, 2, group)
    ranks.wait_for(ranks.path(group, 2).exists, "rank 2 named")
    ranks.kill(doomed)
    reports = [ranks.report(ranks.start(3, r, group)) for r in (0, 1)]
    for report in reports:
        assert "rank 2 exited during set-up" in error(report) or "failed set-up" in error(
            report
        )
        assert report["ended"] - report["called"] < FAST
    assert ranks.tombstones() == [4096] * 3


def test_a_rank_that_cannot_allocate_fails_its_peer_at_once(ranks):
    """Table case 2: a rank whose workspace does not fit (here RLIMIT_FSIZE: the
    allocation fails with EFBIG, as a full /dev/shm fails it with ENOSPC)."""
    group = secrets.token_hex(8)
    failing = ranks.start(2, 1, group, fsize=64 << 10)
    peer = ranks.start(2, 0, group)
    failed, first = ranks.report(failing), ranks.report(peer)
    assert "cannot allocate" in error(failed) and "File too large" in error(failed)
    assert "rank 1 failed set-up" in error(first)
    assert first["ended"] - max(first["called"], failed["called"]) < FAST
    assert ranks.tombstones() == [4096] * 2


def test_a_latecomer_after_a_failure_fails_at_once(ranks):
    """Table case 2: ranks 0 and 1 fail at once (rank 1 was given another size), and
    rank 2 comes after: it sees their failure under their names."""
    group = secrets.token_hex(8)
    first = [ranks.report(p) for p in (ranks.start(3, 0, group), ranks.start(2, 1, group))]
    assert all("found" in error(report) for report in first)
    latecomer = ranks.report(ranks.start(3, 2, group))
    assert "rank 0 failed set-up" in error(latecomer) or "found" in error(latecomer)
    assert latecomer["ended"] - latecomer["called"] < FAST
    assert ranks.tombstones() == [4096] * 3


@pytest.mark.parametrize("step", ["posix_fallocate"])
def test_a_rank_killed_while_its_workspace_is_allocated(ranks, step):
    """Table case 2: a rank killed after its segment has a name, before its workspace
    exists: its peer fails at once."""
    group = secrets.token_hex(8)
    doomed = ranks.start(2, 1, group, stop=step)
    peer = ranks.start(2, 0, group)
    ranks.stopped(doomed)
    killed = ranks.kill(doomed)
    first = ranks.report(peer)
    assert "rank 1 exited during set-up" in error(first)
    assert first["ended"] - killed < FAST
    assert ranks.tombstones() == [4096] * 2


def test_a_forked_child_does_not_keep_a_killed_rank_alive(ranks):
    """Table case 3: the rank forks a helper (it sleeps 120 s) once its segment is
    named, and is killed; the helper must not hold the rank's lock."""
    group = secrets.token_hex(8)
    doomed = ranks.start(2, 1, group, fork_child_s=120)
    ranks.wait_for(ranks.path(group, 1).exists, "rank 1 named")
    ranks.wait_for(lambda: Path(f"/proc/{doomed.pid}/task/{doomed.pid}/children")
                   .read_text().strip(), "rank 1's helper")  # fmt: skip
    killed = ranks.kill(doomed)
    report = ranks.report(ranks.start(2, 0, group))
    assert "rank 1 exited during set-up" in error(report)
    assert report["ended"] - killed < FAST
    assert all(Path(f"/proc/{pid}").exists() for pid in ranks.children)  # still there


def test_a_reclaim_never_takes_a_live_ranks_name(ranks):
    """Table case 4: group g's name is reused, and another group's set-up reclaims g's
    dead leftover: it is stopped between finding the owner gone and unlinking, while the
    leftover goes and a live rank of g names its own segment there."""
    group, other = secrets.token_hex(8), secrets.token_hex(8)
    doomed = ranks.start(2, 1, group)
    ranks.wait_for(ranks.path(group, 1).exists, "the leftover")
    ranks.kill(doomed)
    reclaimer = ranks.start(1, 0, other, stop="flock_sh")
    ranks.stopped(reclaimer)  # it found the leftover's owner gone
    ranks.path(group, 1).unlink()
    live = ranks.start(2, 1, group, value=2)
    ranks.wait_for(ranks.path(group, 1).exists, "the live rank 1 named")
    reclaimer.send_signal(18)  # SIGCONT
    assert ranks.report(reclaimer)["errors"] == [None]
    peer = ranks.report(ranks.start(2, 0, group, value=1))
    assert (peer["errors"], peer["sum"]) == ([None], 3)
    assert ranks.report(live)["errors"] == [None]
    assert ranks.left() == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to make another user's file")
def test_another_users_file_under_a_groups_name_is_an_error_naming_that_user(ranks):
    """Table case 5: another local user created <namespace>_<group>_1 first."""
    group, nobody = secrets.token_hex(8), pwd.getpwnam("nobody")
    planted = ranks.path(group, 1)
    planted.touch(mode=0o600)
    os.chown(planted, nobody.pw_uid, nobody.pw_gid)
    reports = [ranks.report(ranks.start(2, r, group)) for r in (0, 1)]
    for report in reports:
        assert f"{planted} belongs to user nobody (uid {nobody.pw_uid})" in error(report)
        assert report["ended"] - report["called"] < FAST
    # rank 0's segment stays named, shrunk to its header, for a latecomer to see
    assert ranks.left() == [ranks.path(group, 0).name, planted.name]
    assert ranks.path(group, 0).stat().st_size == 4096 and planted.stat().st_size == 0


def test_a_rank_stopped_in_set_up_is_not_taken_for_dead(ranks):
    group = secrets.token_hex(8)
    slow = ranks.start(2, 1, group, stop="posix_fallocate", value=2)
    peer = ranks.start(2, 0, group, value=1)
    ranks.stopped(slow)
    time.sleep(4)
    slow.send_signal(18)  # SIGCONT
    reports = [ranks.report(proc) for proc in (peer, slow)]
    assert [(r["errors"], r["sum"]) for r in reports] == [([None], 3), ([None], 3)]
    assert ranks.left() == []


def test_a_planted_symlink_is_refused_and_its_target_untouched(ranks, tmp_path):
    group, target = secrets.token_hex(8), tmp_path / "target"
    target.write_bytes(b"keep")
    ranks.path(group, 1).symlink_to(target)
    reports = [ranks.report(ranks.start(2, r, group)) for r in (0, 1)]
    assert all(r["errors"][0] for r in reports)
    assert target.read_bytes() == b"keep"
    assert ranks.left() == [ranks.path(group, 0).name, ranks.path(group, 1).name]
    assert ranks.path(group, 1).is_symlink()


def test_a_rank_that_never_comes_fails_its_peer_at_the_deadline_then_a_latecomer_at_once(
    ranks,
):
    group = secrets.token_hex(8)
    report = ranks.report(ranks.start(2, 0, group, timeout=2.0))
    assert f"waited 2 s for rank 1 to create {ranks.path(group, 1)}" in error(report)
    assert ranks.left() == [ranks.path(group, 0).name]  # a tombstone, for a latecomer
    assert ranks.path(group, 0).stat().st_size == 4096
    latecomer = ranks.report(ranks.start(2, 1, group))
    assert "rank 0 failed set-up" in error(latecomer)
    assert latecomer["ended"] - latecomer["called"] < FAST
    assert ranks.tombstones() == [4096] * 2


def test_arguments_are_checked_and_a_process_joins_one_group(ranks):
    group = secrets.token_hex(8)
    ns = ranks.namespace
    bad = [[2**32 + 2, 0, ns, group, 1.0], [2, 2**32, ns, group, 1.0],
           [2, -1, ns, group, 1.0], [0, 0, ns, group, 1.0], [2**16 + 1, 0, ns, group, 1.0],
           [2, 0, ns, group, 0.0], [2, 0, ns, group, 1e9], [2, 0, "a/b", group, 1.0],
           [2, 0, ns, "a_b", 1.0], [2, 0, ns, "", 1.0], [2, 0, "x" * 250, group, 1.0]]
    again = [[1, 0, ns, group, 3.0], [1, 0, ns, "other", 3.0]]  # fmt: skip
    report = ranks.report(ranks.start(1, 0, group, joins=bad + again))
    first, *refused, same, other = report["errors"]
    assert first is None and same is None and report["sum"] == 1
    for message, (size, rank, *_) in zip(refused[:5], bad):
        assert f"size {size} and rank {rank}: expected" in message
    assert all(refused), refused
    assert f"cannot also be rank 0 of group '{ns}_other'" in other
    assert ranks.left() == []
