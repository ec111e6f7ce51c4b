"""Bounds on every input of `python -m sglang.srt.placement_tools`: flags, environment variables, sysfs and snapshot
files, and the capture destination.

Each bad input ends at once with exit status 2 and one line on stderr that names it: never a traceback, a
MemoryError after gigabytes, or a hang. The command-line cases run as real processes under a 1 GiB address
space limit and a timeout, so that code without the bounds fails these tests instead of exhausting the host.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import fakesys
import pytest
from cli_limits import (
    assert_one_line,
    assert_usage_error,
    deadline,
    in_child,
    memory_cap,
    run_cli,
)

from sglang.srt.placement.cpulist import parse_cpulist
from sglang.srt.placement.topology import SNAPSHOT_MARKER
from sglang.srt.placement_tools.__main__ import build_parser, main
from sglang.srt.placement_tools.capture import capture_sysfs

ONLINE = "devices/system/cpu/online"
OTHER_UID = 1001


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("SGLANG_") or name == "CUDA_VISIBLE_DEVICES":
            monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def bounded():
    """In-process calls too: a missing bound is a MemoryError or a Hang here, not the host's OOM killer."""
    with memory_cap(), deadline(120):
        yield


@pytest.fixture
def tree(tmp_path):
    return fakesys.two_sockets_four_gpus(tmp_path / "sys")


@pytest.fixture
def snapshot(tmp_path, tree):
    """A snapshot made by capture (so it has a marker) of the two-socket tree."""
    capture_sysfs(tmp_path / "snap", root=tree)
    return tmp_path / "snap"


def replace_with(path: Path, kind: str) -> None:
    """Make ``path`` a FIFO, a link to a device or a link loop."""
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "loop":
        path.symlink_to(path.name)
    else:
        path.symlink_to(kind)


# 1. CPU ids are bounded (8191, Linux's largest CONFIG_NR_CPUS less one) before any range is built.


def test_allowed_cpus_beyond_the_kernels_cpu_limit(tree):
    done = run_cli(
        "plan",
        "--device",
        "cpu",
        "--sysfs-root",
        tree,
        "--allowed-cpus",
        "0-4294967296",
    )
    assert_usage_error(
        done,
        "--allowed-cpus",
        "'0-4294967296'",
        "4294967296 is above the largest CPU id",
        "8191",
    )
    assert done.seconds < 10


def test_omp_threads_bind_beyond_the_kernels_cpu_limit(tree):
    done = run_cli(
        "plan",
        "--device",
        "cpu",
        "--sysfs-root",
        tree,
        env={"SGLANG_CPU_OMP_THREADS_BIND": "0-4294967296"},
    )
    assert_usage_error(done, "SGLANG_CPU_OMP_THREADS_BIND", "'0-4294967296'")
    assert done.seconds < 10


def _parse_cpulist(text, what):
    return parse_cpulist(text, what=what)


def test_cpulist_takes_ascii_cpu_ids_below_8192():
    assert parse_cpulist("8191") == {8191}
    assert len(parse_cpulist("0-8191")) == 8192
    assert parse_cpulist(" 0 - 3 , 8 ") == {0, 1, 2, 3, 8}
    assert parse_cpulist("0-7:2,0009") == {0, 2, 4, 6, 9}
    for text in (
        "8192",
        "0-8192",
        "0-99999999999999999999",
        "9" * 5000,
        "٣",
        "0-٣",
        "²",
        "1_0",
        "+3",
        "-1",
        "0x10",
        "1e3",
        "0\x00",
        "0-3:0",
        "3-1",
    ):
        kind, message = in_child(_parse_cpulist, text, "--flag")
        assert kind == "ValueError" and message.startswith("--flag: "), (
            text,
            kind,
            message[:200],
        )


def test_cpulist_of_many_overlapping_ranges_is_quick():
    start = time.monotonic()
    assert len(parse_cpulist(",".join(["0-8191"] * 9000))) == 8192
    assert len(parse_cpulist(",".join(["1-8191:2"] * 7000))) == 4096
    assert time.monotonic() - start < 2
    with pytest.raises(ValueError, match="characters long"):
        parse_cpulist("0," * 40000)


# 2. Every integer flag has a ceiling; the error names the flag, the value and the limit.


@pytest.mark.parametrize(
    "flag, limit",
    [
        ("--tp-size", "65536"),
        ("--pp-size", "65536"),
        ("--dp-size", "65536"),
        ("--nnodes", "65536"),
        ("--node-rank", "65535"),
        ("--base-gpu-id", "4095"),
        ("--gpu-id-step", "4095"),
        ("--numa-node", "1023"),
    ],
)
def test_integer_flags_have_a_ceiling(tree, flag, limit):
    done = run_cli("plan", "--sysfs-root", tree, flag, "100000000")
    assert_usage_error(done, f"{flag}=100000000 is not valid", f"to {limit}")
    assert done.seconds < 10


def test_the_ranks_of_an_engine_have_a_ceiling(tree):
    done = run_cli(
        "plan", "--sysfs-root", tree, "--tp-size", "4096", "--dp-size", "4096"
    )
    assert_usage_error(
        done, "--tp-size=4096 x --pp-size=1 x --dp-size=4096 = 16777216 ranks", "65536"
    )
    assert done.seconds < 10


@pytest.mark.parametrize(
    "value", ["٣", "²", "1_0", "0x10", "1e3", " ", "+", "99999999999999999999999999"]
)
def test_integer_flags_take_ascii_decimal_digits(tree, value):
    done = run_cli("plan", "--sysfs-root", tree, "--tp-size", value)
    assert_usage_error(
        done, "argument --tensor-parallel-size/--tp-size/--tp:", "--tp-size"
    )


# 3. A snapshot whose online CPU list is huge.


def test_snapshot_with_a_huge_online_cpu_list(tmp_path, snapshot):
    (snapshot / ONLINE).write_text("0-4294967295\n")
    done = run_cli("plan", "--sysfs-root", snapshot)
    assert_usage_error(
        done,
        f"{snapshot}/{ONLINE}: '0-4294967295' is not a CPU list",
        "8191",
        "re-capture it on the host it describes",
    )
    assert done.seconds < 10
    again = run_cli("capture", tmp_path / "again", "--sysfs-root", snapshot)
    assert_usage_error(again, f"{snapshot}/{ONLINE}", "8191")
    assert not (tmp_path / "again").exists()


# 4 and 5. Snapshot files that are devices, FIFOs, link loops or too large; the live /sys still reads.


@pytest.mark.parametrize(
    "kind, problem",
    [
        ("/dev/zero", "is a character device, expected a regular file"),
        ("/dev/urandom", "is a character device, expected a regular file"),
        ("fifo", "is a FIFO, expected a regular file"),
        ("loop", "cannot be read (Too many levels of symbolic links)"),
    ],
)
@pytest.mark.parametrize(
    "rel",
    [ONLINE, "devices/system/cpu/cpu3/topology/thread_siblings_list", SNAPSHOT_MARKER],
)
def test_snapshot_file_that_is_not_a_regular_file(
    tmp_path, snapshot, kind, problem, rel
):
    replace_with(snapshot / rel, kind)
    done = run_cli("plan", "--sysfs-root", snapshot, timeout=10)
    assert_usage_error(done, f"{snapshot}/{rel}: {problem}")
    assert done.seconds < 5
    again = run_cli("capture", tmp_path / "again", "--sysfs-root", snapshot, timeout=10)
    assert_usage_error(again, f"{snapshot}/{rel}: {problem}")
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize("rel", [ONLINE, SNAPSHOT_MARKER])
def test_snapshot_file_larger_than_64_kib(snapshot, rel):
    (snapshot / rel).write_text("0," * 40000)
    assert_usage_error(
        run_cli("plan", "--sysfs-root", snapshot),
        f"{snapshot}/{rel}: is larger than 65536 bytes",
    )


def test_sysfs_root_that_is_a_fifo_or_a_device(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    for root in (tmp_path / "fifo", "/dev/zero"):
        assert_usage_error(
            run_cli("plan", "--sysfs-root", root, timeout=10),
            f"{root}: is not a directory",
        )


def test_live_sysfs_attributes_are_regular_files_and_still_read():
    done = run_cli(
        "plan",
        "--device",
        "cpu",
        "--allowed-cpus",
        "0",
        env={"SGLANG_CPU_OMP_THREADS_BIND": "0"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("[DP0 PP0 TP0] CPU rank 0: node 0 CPUs 0 ")
    assert run_cli("plan", "--device", "cpu").returncode == 0


# 6. The snapshot marker: size, depth, encoding, and its kernel_release escaped wherever printed.


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"[" * 200_000, "is larger than 65536 bytes"),
        (
            b"[" * 60_000,
            "is not a readable snapshot marker (maximum recursion depth exceeded",
        ),
        (
            b"\xff\xfe{}",
            "is not a readable snapshot marker ('utf-8' codec can't decode",
        ),
        (b'{"format": 1', "is not a readable snapshot marker (Expecting"),
        (
            b'{"format": ' + b"9" * 5000 + b"}",
            "is not a readable snapshot marker (Exceeds the limit",
        ),
        (b"", "is not a readable snapshot marker (Expecting value"),
        (b"[1]", "has no integer 'format' field"),
    ],
)
def test_marker_that_does_not_parse(snapshot, content, problem):
    (snapshot / SNAPSHOT_MARKER).write_bytes(content)
    done = run_cli("plan", "--sysfs-root", snapshot)
    assert_usage_error(
        done, f"{snapshot}/{SNAPSHOT_MARKER}: {problem}", "re-capture the snapshot"
    )


def test_marker_kernel_release_is_escaped(snapshot):
    marker = json.loads((snapshot / SNAPSHOT_MARKER).read_text())
    marker["kernel_release"] = "6.1\x00\n\x1b[31mred\r"
    marker["captured_at"] = "\u202eyesterday"
    (snapshot / SNAPSHOT_MARKER).write_text(json.dumps(marker))
    (snapshot / ONLINE).unlink()
    done = run_cli("plan", "--sysfs-root", snapshot)
    line = assert_usage_error(
        done,
        f"{snapshot}/{ONLINE}: missing",
        r"captured from kernel 6.1\x00\n\x1b[31mred\r at \u202eyesterday",
    )
    assert (
        "\x00" not in done.stderr
        and "\x1b" not in done.stderr
        and "\r" not in done.stderr
    )
    assert "re-capture it on the host it describes" in line


# 7. verify --timeout: finite, above 0, at most a day; the error names --timeout.


@pytest.mark.parametrize(
    "value", ["-1", "0", "1e400", "nan", "inf", "-inf", "86401", "٣", "0x10", ""]
)
def test_verify_timeout_is_bounded(value):
    done = run_cli(
        "verify",
        "--device",
        "cpu",
        f"--timeout={value}",
        env={"SGLANG_CPU_OMP_THREADS_BIND": "0"},
        timeout=30,
    )
    assert_usage_error(done, "argument --timeout", "86400")


def test_verify_timeout_takes_seconds():
    parser = build_parser()
    assert parser.parse_args(["verify", "--timeout", "2.5"]).timeout == 2.5
    assert parser.parse_args(["verify", "--timeout", "86400"]).timeout == 86400.0
    assert parser.parse_args(["verify"]).timeout == 120.0


# 8. capture writes only into a directory of its own, never through a planted link.


@pytest.fixture
def shared_dir():
    """A directory that uid 1001 can reach, holding a root-only directory ``secret``."""
    if os.geteuid() != 0:
        pytest.skip(f"needs root: chowns to uid {OTHER_UID} and acts as that user")
    base = Path(tempfile.mkdtemp(prefix="capture-attack-", dir="/tmp"))
    base.chmod(0o755)
    (base / "secret").mkdir(mode=0o700)
    try:
        yield base
    finally:
        shutil.rmtree(base)


def as_other_user(action):
    """Run ``action`` in a forked child with uid and gid 1001; return the child's pid."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([])
            os.setresgid(OTHER_UID, OTHER_UID, OTHER_UID)
            os.setresuid(OTHER_UID, OTHER_UID, OTHER_UID)
            action()
            code = 0
        finally:
            os._exit(code)
    return pid


def stop(pid):
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def wait_for(path: Path, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if os.path.lexists(path):
            return True
    return False


def many_devices_tree(root: Path) -> Path:
    """A host with 300 PCI devices: capture spends a while in bus/ before it writes devices/."""
    return fakesys.write_sysfs(
        root,
        fakesys.Host(
            nodes={0: fakesys.NodeSpec(cpus=frozenset(range(2)))},
            pci=[fakesys.PciSpec(fakesys.gpu_address(i), 0) for i in range(300)],
        ),
    )


def test_capture_refuses_a_directory_of_another_user_with_a_planted_link(
    tmp_path, shared_dir
):
    dest = shared_dir / "snap"
    dest.mkdir(mode=0o755)
    os.chown(dest, OTHER_UID, OTHER_UID)
    root = many_devices_tree(tmp_path / "sys")

    def plant():
        if wait_for(dest / "bus"):
            os.symlink(shared_dir / "secret", dest / "devices")

    attacker = as_other_user(plant)
    try:
        done = run_cli("capture", dest, "--sysfs-root", root, timeout=60)
    finally:
        stop(attacker)
    assert os.listdir(shared_dir / "secret") == []
    assert_usage_error(done, f"{dest}: belongs to uid {OTHER_UID}, not to this user")
    assert os.listdir(dest) == []


def test_capture_planted_link_before_the_start_is_refused(tmp_path, shared_dir):
    dest = shared_dir / "snap"
    theirs = shared_dir / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    as_link = theirs / "link"
    _, status = os.waitpid(
        as_other_user(lambda: os.symlink(shared_dir / "secret", as_link)), 0
    )
    assert status == 0 and as_link.is_symlink()
    root = fakesys.one_node(tmp_path / "sys")
    assert_usage_error(
        run_cli("capture", as_link, "--sysfs-root", root),
        f"{as_link}: exists and is not a directory",
    )
    dest.mkdir(mode=0o777)
    dest.chmod(0o777)
    assert_usage_error(
        run_cli("capture", dest, "--sysfs-root", root),
        f"{dest}: may be written by other users",
    )
    assert os.listdir(shared_dir / "secret") == [] and os.listdir(dest) == []


def exchange(a: Path, b: Path) -> None:
    """Swap two names atomically (renameat2 RENAME_EXCHANGE): no moment where either is missing."""
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, rename_exchange = -100, 2
    if libc.renameat2(at_fdcwd, bytes(a), at_fdcwd, bytes(b), rename_exchange) != 0:
        raise OSError(ctypes.get_errno(), f"renameat2 {a} {b}")


def test_capture_into_a_parent_of_another_user_never_writes_through_a_swapped_link(
    tmp_path, shared_dir
):
    """The other user owns the parent: once capture has begun, they swap its directory for one of their own
    whose devices/ links to the root-only directory. Capture writes on into the directory it created.
    """
    parent = shared_dir / "theirs"
    parent.mkdir(mode=0o755)
    os.chown(parent, OTHER_UID, OTHER_UID)
    dest = parent / "snap"
    root = many_devices_tree(tmp_path / "sys")
    addresses = os.listdir(root / "bus/pci/devices")

    def swap():
        decoy = parent / "decoy"
        for address in addresses:
            os.makedirs(decoy / "bus/pci/devices" / address)
        os.symlink(shared_dir / "secret", decoy / "devices")
        if wait_for(dest / "bus"):
            exchange(dest, decoy)

    attacker = as_other_user(swap)
    try:
        time.sleep(0.5)  # the decoy is ready
        done = run_cli("capture", dest, "--sysfs-root", root, timeout=60)
    finally:
        stop(attacker)
    assert os.listdir(shared_dir / "secret") == []
    assert os.stat(parent / "decoy").st_uid == 0, "the swap did not happen"
    assert done.returncode == 0, done.stderr
    assert (parent / "decoy" / SNAPSHOT_MARKER).is_file() and not (
        dest / SNAPSHOT_MARKER
    ).exists()


def test_failed_write_removes_what_capture_created(tmp_path):
    root = fakesys.two_sockets_four_gpus(tmp_path / "sys")
    # Files over 12 bytes cannot be written: the PCI files are, the CPU lists and the marker are not.
    done = run_cli("capture", tmp_path / "snap", "--sysfs-root", root, file_size=12)
    assert_usage_error(
        done, f"{tmp_path}/snap: cannot write the snapshot", "nothing was left behind"
    )
    assert not (tmp_path / "snap").exists()
    (tmp_path / "empty").mkdir()
    done = run_cli("capture", tmp_path / "empty", "--sysfs-root", root, file_size=12)
    assert_usage_error(done, f"{tmp_path}/empty: cannot write the snapshot")
    assert os.listdir(tmp_path / "empty") == []


@pytest.mark.parametrize(
    "make, problem",
    [
        (lambda d: os.mkfifo(d), "exists and is not a directory"),
        (lambda d: d.symlink_to(d.name), "exists and is not a directory"),
        (lambda d: d.symlink_to("/dev/zero"), "exists and is not a directory"),
        (lambda d: d.write_text(""), "exists and is not a directory"),
    ],
)
def test_capture_destination_that_is_not_a_directory(tmp_path, make, problem):
    dest = tmp_path / "dest"
    make(dest)
    done = run_cli(
        "capture", dest, "--sysfs-root", fakesys.one_node(tmp_path / "sys"), timeout=10
    )
    assert_usage_error(done, f"{dest}: {problem}")


# 9. Whatever a parser raises is exit 2 and one printable line.


@pytest.mark.parametrize(
    "error",
    [
        MemoryError(),
        RecursionError("maximum recursion depth exceeded"),
        OverflowError("int too large to convert to float"),
        OSError(5, "Input/output error"),
        UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
        ValueError("first line\nsecond line"),
    ],
)
def test_any_parser_failure_is_one_line_and_exit_2(tree, capsys, monkeypatch, error):
    def fail(root, **_):
        raise error

    monkeypatch.setattr("sglang.srt.placement_tools.__main__.read_topology", fail)
    assert main(["plan", "--sysfs-root", str(tree)]) == 2
    line = assert_one_line(capsys.readouterr().err)
    assert type(error).__name__ in line or str(error).split("\n")[0] in line


def test_control_characters_in_a_value_are_escaped(tmp_path):
    done = run_cli("plan", "--sysfs-root", f"{tmp_path}/nowhere\x1b[2J\nx\r")
    assert_usage_error(done, f"{tmp_path}/nowhere\\x1b[2J\\nx\\r: does not exist")


def test_nul_in_a_flag_value_is_named(tmp_path, capsys):
    assert main(["plan", "--sysfs-root", f"{tmp_path}/a\x00b"]) == 2
    assert main(["capture", f"{tmp_path}/a\x00b"]) == 2
    assert main(["plan", "--allowed-cpus", "0\x00"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and all(line.isprintable() for line in lines)
    assert "--sysfs-root=" in lines[0] and "a\\x00b" in lines[0] and "NUL" in lines[0]
    assert "DIR=" in lines[1] and "a\\x00b" in lines[1] and "NUL" in lines[1]
    assert "--allowed-cpus" in lines[2] and "'0\\x00'" in lines[2]


def test_a_very_long_error_line_is_cut(tree):
    done = run_cli(
        "plan",
        "--device",
        "cpu",
        "--sysfs-root",
        tree,
        env={"SGLANG_CPU_OMP_THREADS_BIND": "0-" * 50_000},
    )
    line = assert_usage_error(done, "SGLANG_CPU_OMP_THREADS_BIND", "characters)")
    assert len(line) < 2200
