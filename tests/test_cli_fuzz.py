"""Malformed input, generated from a fixed seed, for `plan`, `capture`, the placement environment variables and
the files of a snapshot.

Every run must end within a few seconds, either with exit status 0 (the generator may make a valid value) or
with exit status 2 and one printable line on stderr that names the flag, the variable or the file, and no
traceback. The runs call ``main(argv)`` in-process under a deadline and an address-space cap; a sample of about
twenty also runs as real processes, to hold the contract end to end.

NUL goes into flags (in-process only: execve cannot pass it) and into files, never into environment values,
which cannot hold it. The boolean variables may later warn and keep their default for a bad value, as upstream
sglang's do: for them exit 0 (with or without a warning) is as good as exit 2.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import fakesys
import pytest
from cli_limits import assert_one_line, deadline, memory_cap, run_cli

from sglang.srt.placement.cpulist import shown
from sglang.srt.placement.topology import SNAPSHOT_MARKER
from sglang.srt.placement_tools.__main__ import main
from sglang.srt.placement_tools.capture import capture_sysfs

SEED = 20240611
SECONDS_PER_RUN = 5.0
SUBPROCESS_SAMPLE = 20
BOOL_VARIABLES = (
    "SGLANG_NUMA_BIND_V2",
    "SGLANG_AUTO_NUMA_BIND",
    "SGLANG_CRASH_ON_NUMA_BIND_FAILURE",
    "SGLANG_SET_CPU_AFFINITY",
)

HUGE = [
    "4294967296",
    "4294967295",
    "18446744073709551616",
    "9" * 30,
    "1" + "0" * 400,
    "9" * 5000,
]
UNICODE_DIGITS = ["²", "٣", "٣٣", "¹-³", "0-٣", "１", "߃", "৩"]
CONTROL = ["\x1b[2J", "\x07", "\r", "\n", "\t", "\x7f", "\u202e", "\udcff"]
TOKENS = [
    "0",
    "1",
    "7",
    "-",
    ",",
    ":",
    "|",
    " ",
    "x",
    "-1",
    "٣",
    "²",
    "\x1b",
    "\n",
    "0x",
    "e",
    ".",
    "+",
    "_",
]


@dataclass
class Case:
    what: str
    """The input under test, for failure messages."""
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    names: tuple[str, ...] = ()
    """An exit-2 line must hold one of these."""

    @property
    def warn_ok(self) -> bool:
        return any(name in self.env for name in BOOL_VARIABLES)

    @property
    def execable(self) -> bool:
        return not any("\0" in arg for arg in self.argv)


def garbage(rng: random.Random) -> str:
    return "".join(rng.choice(TOKENS) for _ in range(rng.randint(1, 8)))


def number_values(rng: random.Random) -> list[str]:
    values = (
        HUGE
        + UNICODE_DIGITS[:4]
        + [
            "-1",
            "-0",
            "0",
            "1.5",
            "nan",
            "inf",
            "1e9",
            "0x10",
            "1_0",
            "",
            " ",
            "+",
            "3\x00",
        ]
    )
    return values + [garbage(rng) for _ in range(4)] + [rng.choice(CONTROL) + "2"]


def cpulist_values(rng: random.Random, *, nul: bool) -> list[str]:
    values = [f"0-{n}" for n in HUGE[:4]] + [
        HUGE[0],
        "0-8192",
        "8191-8192",
        "0-3:0",
        "0-3:" + HUGE[2],
        "3-1",
        "-1",
        "-5-3",
        "0--1",
        ",",
        "0,,1",
        "1e3",
        "0x10",
        "1_0",
        "+3",
        ",".join(["0-8191"] * 9000),
        "0," * 40000,
    ]
    values += (
        UNICODE_DIGITS[:5]
        + [c + "0" for c in CONTROL[:4]]
        + [garbage(rng) for _ in range(6)]
    )
    if nul:
        values += ["0\x00", "\x00"]
    return values


def flag_case(argv: list[str], flag: str, value: str) -> Case:
    return Case(f"{flag} {shown(value, limit=40)}", [*argv, flag, value], names=(flag,))


def env_case(argv: list[str], name: str, value: str) -> Case:
    return Case(
        f"{name}={shown(value, limit=40)}", argv, env={name: value}, names=(name,)
    )


def plan_cases(rng: random.Random, tree: Path) -> list[Case]:
    base = ["plan", "--sysfs-root", str(tree)]
    cases = []
    for flag in (
        "--tp-size",
        "--pp-size",
        "--dp-size",
        "--nnodes",
        "--node-rank",
        "--base-gpu-id",
        "--gpu-id-step",
        "--numa-node",
    ):
        cases += [
            flag_case(base, flag, value) for value in rng.sample(number_values(rng), 12)
        ]
    cases += [
        flag_case(base, "--allowed-cpus", value)
        for value in rng.sample(cpulist_values(rng, nul=True), 16)
    ]
    for flag in ("--gpus", "--launcher", "--device"):
        for value in [garbage(rng) for _ in range(4)] + [
            "\x00",
            "0000:18:00.0," * 5000,
            rng.choice(CONTROL),
        ]:
            cases.append(flag_case(base, flag, value))
    return cases


def path_values(tmp: Path) -> dict[str, str]:
    """Paths that are no directory to read or write: FIFO, devices, a link loop, a file, NUL, controls."""
    os.mkfifo(tmp / "fifo")
    (tmp / "loop").symlink_to("loop")
    (tmp / "zero").symlink_to("/dev/zero")
    (tmp / "file").write_text("0-3\n")
    (tmp / "full").mkdir()
    (tmp / "full" / "x").write_text("")
    return {
        "fifo": str(tmp / "fifo"),
        "loop": str(tmp / "loop"),
        "link to /dev/zero": str(tmp / "zero"),
        "/dev/zero": "/dev/zero",
        "/dev/urandom": "/dev/urandom",
        "file": str(tmp / "file"),
        "non-empty dir": str(tmp / "full"),
        "missing parent": str(tmp / "no" / "such" / "dir"),
        "NUL": f"{tmp}/nul\x00",
        "controls": f"{tmp}/no\x1b[2J\n\r/x",
        "empty": "",
        "root": "/",
        "unicode": f"{tmp}/no/٣²\u202e",
    }


def capture_cases(tmp: Path, tree: Path, snapshots: dict[str, Path]) -> list[Case]:
    cases = []
    for label, path in path_values(tmp).items():
        cases.append(
            Case(
                f"capture DIR {label}",
                ["capture", path, "--sysfs-root", str(tree)],
                names=("DIR", path, "/dev/zero", "/dev/urandom", str(tmp)),
            )
        )
        cases.append(
            Case(
                f"capture --sysfs-root {label}",
                ["capture", str(tmp / f"out-{len(cases)}"), "--sysfs-root", path],
                names=("--sysfs-root", path, str(tmp)),
            )
        )
    for label, snap in snapshots.items():
        rel = label.split(" <- ")[0]
        cases.append(
            Case(
                f"plan, snapshot {label}",
                ["plan", "--sysfs-root", str(snap)],
                names=(rel,),
            )
        )
        cases.append(
            Case(
                f"capture, snapshot {label}",
                ["capture", str(tmp / f"out-{len(cases)}"), "--sysfs-root", str(snap)],
                names=(rel,),
            )
        )
    return cases


def env_cases(rng: random.Random, tree: Path) -> list[Case]:
    cpu_plan = ["plan", "--device", "cpu", "--sysfs-root", str(tree)]
    cases = [
        env_case(cpu_plan, "SGLANG_CPU_OMP_THREADS_BIND", value)
        for value in rng.sample(cpulist_values(rng, nul=False), 20)
        + ["0|1", "0-3|" * 3000, "|", " "]
    ]
    words = [
        "",
        " ",
        "maybe",
        "TRUE\x1b",
        "1\n",
        "２",
        "yes please",
        "-1",
        "nodes",
        "exclusive\r",
        "\udcff",
        HUGE[-1],
    ]
    for name in BOOL_VARIABLES:
        cases += [
            env_case(["plan", "--sysfs-root", str(tree)], name, value)
            for value in words + [garbage(rng) for _ in range(3)]
        ]
    return cases


SNAPSHOT_FILES = [
    "devices/system/cpu/online",
    "devices/system/cpu/cpu5/topology/thread_siblings_list",
    "devices/system/cpu/cpu5/topology/core_id",
    "devices/system/cpu/cpu5/topology/physical_package_id",
    "devices/system/node/node1/cpulist",
    "devices/system/node/node1/meminfo",
    "bus/pci/devices/0000:28:00.0/numa_node",
    SNAPSHOT_MARKER,
]


def file_mutations(rng: random.Random) -> dict[str, object]:
    """Contents (bytes) or kinds ("fifo", "loop", "dir", a device path) for a snapshot file."""
    return {
        "huge range": b"0-4294967295\n",
        "huge number": HUGE[-1].encode(),
        "unicode digits": "٣-²\n".encode(),
        "NUL": b"0\x00-3\n",
        "controls": b"\x1b[2J\r\n\x07",
        "negative": b"-5\n",
        "empty": b"",
        "invalid UTF-8": b"\xff\xfe\xfd",
        "oversize": b"0," * 40000,
        "deep JSON": b"[" * 60000,
        "very deep JSON": b"[" * 200000,
        "garbage": garbage(rng).encode("utf-8", "surrogateescape"),
        "fifo": "fifo",
        "link loop": "loop",
        "directory": "dir",
        "/dev/zero": "/dev/zero",
        "/dev/urandom": "/dev/urandom",
    }


def mutate(path: Path, mutation: object) -> None:
    path.unlink()
    if isinstance(mutation, bytes):
        path.write_bytes(mutation)
    elif mutation == "fifo":
        os.mkfifo(path)
    elif mutation == "loop":
        path.symlink_to(path.name)
    elif mutation == "dir":
        path.mkdir()
    else:
        path.symlink_to(mutation)


def mutated_snapshots(rng: random.Random, snapshot: Path, tmp: Path) -> dict[str, Path]:
    made = {}
    mutations = file_mutations(rng)
    for rel in SNAPSHOT_FILES:
        for label in rng.sample(sorted(mutations), 9):
            copy = tmp / f"snap-{len(made)}"
            shutil.copytree(
                snapshot, copy, symlinks=True, copy_function=os.link
            )  # mutate() unlinks first
            mutate(copy / rel, mutations[label])
            made[f"{rel} <- {label}"] = copy
    return made


def run_in_process(case: Case, monkeypatch) -> tuple[int, str, float]:
    err = io.StringIO()
    start = time.monotonic()
    with monkeypatch.context() as env:
        for name, value in case.env.items():
            env.setenv(name, value)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(
            err
        ), memory_cap(), deadline(SECONDS_PER_RUN):
            code = main(case.argv)
    return code, err.getvalue(), time.monotonic() - start


def check(case: Case, code: int, stderr: str) -> None:
    assert "Traceback" not in stderr, (case.what, stderr[-2000:])
    if code == 0:
        return
    assert code == 2, (case.what, code, stderr[-2000:])
    line = assert_one_line(stderr)
    assert any(name in line for name in case.names), (case.what, case.names, line)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("SGLANG_") or name == "CUDA_VISIBLE_DEVICES":
            monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> list[Case]:
    rng = random.Random(SEED)
    tmp = tmp_path_factory.mktemp("fuzz")
    tree = fakesys.two_sockets_four_gpus(tmp / "sys")
    capture_sysfs(tmp / "snap", root=tree)
    snapshots = mutated_snapshots(rng, tmp / "snap", tmp)
    return (
        plan_cases(rng, tree)
        + env_cases(rng, tree)
        + capture_cases(tmp, tree, snapshots)
    )


def test_malformed_input_is_exit_2_with_one_line_naming_it(cases, monkeypatch):
    counts = {0: 0, 2: 0}
    slowest = (0.0, "")
    for case in cases:
        code, stderr, seconds = run_in_process(case, monkeypatch)
        check(case, code, stderr)
        counts[code] += 1
        slowest = max(slowest, (seconds, case.what))
    print(
        f"\nfuzz: {len(cases)} values in-process: exit 2 {counts[2]}, exit 0 {counts[0]}, "
        f"slowest {slowest[0]:.2f} s ({slowest[1]})"
    )
    assert len(cases) >= 300
    assert counts[2] >= 0.75 * len(cases), counts  # booleans warn and keep defaults
    assert slowest[0] < SECONDS_PER_RUN


def test_a_sample_holds_the_contract_as_real_processes(cases):
    candidates = [case for case in cases if case.execable]
    sample = random.Random(SEED).sample(candidates, SUBPROCESS_SAMPLE)
    slowest = 0.0
    for case in sample:
        argv = list(case.argv)
        if argv[0] == "capture" and "/out-" in argv[1]:
            argv[1] += "-process"  # the in-process run wrote the first destination
        done = run_cli(*argv, env=case.env, timeout=30)
        check(case, done.returncode, done.stderr)
        slowest = max(slowest, done.seconds)
    print(f"\nfuzz: {len(sample)} values as processes, slowest {slowest:.2f} s")
    assert slowest < 10
