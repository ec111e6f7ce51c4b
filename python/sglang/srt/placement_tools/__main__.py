"""plan | verify | capture: show, check and snapshot where sglang's ranks run."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import logging
import math
import os
import re
import sys
import warnings
from typing import Callable, Optional, Sequence

from sglang.srt.environ import envs
from sglang.srt.placement import settings
from sglang.srt.placement.cpulist import elide, format_cpulist, parse_cpulist, shown
from sglang.srt.placement.devices import is_live
from sglang.srt.placement.modes import AffinityMode
from sglang.srt.placement.numactl import NumactlProber
from sglang.srt.placement.resolve import HostCapabilities, HostFacts
from sglang.srt.placement.settings import PlacementPolicy
from sglang.srt.placement.topology import read_process_affinity, read_topology
from sglang.srt.placement.types import PlacementError, ProcessAffinity
from sglang.srt.placement_tools import PlanArgs, UsageError
from sglang.srt.placement_tools.capture import capture_sysfs
from sglang.srt.placement_tools.engine import describe, plan_engine, to_dict
from sglang.srt.placement_tools.verify import format_verify_rows, verify_mp

PROG = "python -m sglang.srt.placement_tools"
MAX_TIMEOUT_S = 86400.0
MAX_MESSAGE_CHARS = 2000  # an error line longer than this is cut in the middle
# Bad input of any kind, even what no bound foresaw: one line, exit status 2.
BAD_INPUT = (
    PlacementError,
    ValueError,
    OSError,
    ArithmeticError,
    MemoryError,
    RecursionError,
)
PLAN_JSON_KEYS = (
    "dp_rank pp_rank tp_rank gpu_id pci numa_node cpus mem_policy strategy reasons "
    "numactl_args mem_nodes"
).split()

_FLOAT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one clear line, no usage dump
        raise UsageError(f"{self.prog}: {message} (see --help)")


def _seconds(text: str) -> float:
    """--timeout: finite seconds (no nan, inf or 1e400), above 0, at most a day."""
    word = text.strip()
    value = float(word) if _FLOAT.fullmatch(word) else math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        raise argparse.ArgumentTypeError(
            f"--timeout={shown(word, quote=False)} is not valid: it must be a number "
            f"of seconds above 0 and at most {MAX_TIMEOUT_S:g}"
        )
    return value


def _path(flag: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if not text or "\0" in text:
            why = " (a path cannot hold a NUL byte)" if text else ""
            raise argparse.ArgumentTypeError(
                f"{flag}={shown(text)} is not valid: give a path{why}"
            )
        return text

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    plan = sub.add_parser("plan", help="where each rank of this host runs, and why")
    verify = sub.add_parser("verify", help="start the ranks, read each binding back")
    for command, launchers in ((plan, ("mp", "ray")), (verify, ("mp", "ray", "both"))):
        PlanArgs.add_cli_args(command)
        command.add_argument("--launcher", choices=launchers, default="mp")
        command.add_argument(
            "--sysfs-root", type=_path("--sysfs-root"), help="a `capture` to plan from"
        )
        command.add_argument("--gpus", help="PCI addresses in device-index order")
        command.add_argument("--allowed-cpus", help="CPUs the ranks may use, e.g. 0-15")
        command.add_argument(
            "--numa-affinity-mode", choices=[mode.value for mode in AffinityMode]
        )
        command.add_argument("--json", action="store_true")
    # One thread per dp rank, as sglang's data-parallel controller starts them.
    verify.add_argument("--dp-threads", action="store_true")
    verify.add_argument("--timeout", type=_seconds, default=120.0, help="seconds")
    capture = sub.add_parser("capture", help="copy the sysfs files plan reads into DIR")
    capture.add_argument("dir", metavar="DIR", type=_path("DIR"))
    capture.add_argument("--sysfs-root", default="/sys", type=_path("--sysfs-root"))
    for command in sub.choices.values():
        command.add_argument(
            "-v", "--verbose", action="store_true", help="show warnings and Ray notices"
        )
    return parser


class _Unprobed(NumactlProber):  # a snapshot's host: its numactl is assumed to agree
    def probe(self, args: Sequence[str]) -> Optional[str]:
        return None


def _plan_facts(args: argparse.Namespace) -> HostFacts:
    """This host's, or a snapshot's (all its online CPUs, numactl not probed), narrowed
    to ``--allowed-cpus``."""
    root = args.sysfs_root or settings.sysfs_root()
    if args.sysfs_root is None and not os.path.isdir(root):
        raise UsageError(
            f"SGLANG_SYSFS_ROOT={shown(root)} is not a directory: unset it, or set it "
            f"to /sys or to a snapshot made with `{PROG} capture DIR`"
        )
    setting = "--sysfs-root" if args.sysfs_root else "SGLANG_SYSFS_ROOT"
    topology = read_topology(root, setting=setting)
    if is_live(topology):
        affinity, capabilities = read_process_affinity(), HostCapabilities.live()
    else:
        mems = frozenset(n.node_id for n in topology.nodes if n.has_memory)
        source = "the snapshot (all online CPUs)"
        affinity = ProcessAffinity(topology.online_cpus, mems, source)
        unprobed = _Unprobed(numactl_path="numactl")
        capabilities = HostCapabilities(numactl=unprobed, libnuma=True)
    if args.allowed_cpus is not None:
        cpus = parse_cpulist(args.allowed_cpus, what="--allowed-cpus")
        unknown = cpus - topology.online_cpus
        if not cpus or unknown:
            raise UsageError(
                f"--allowed-cpus={shown(args.allowed_cpus)} names CPU(s) "
                f"{format_cpulist(unknown) or 'none'} that are not online in {root} "
                f"(online: {format_cpulist(topology.online_cpus)})"
            )
        affinity = ProcessAffinity(cpus, affinity.mems, "--allowed-cpus")
    return HostFacts(topology=topology, affinity=affinity, capabilities=capabilities)


def cmd_plan(args: argparse.Namespace) -> int:
    server_args, facts = PlanArgs.from_cli_args(args), _plan_facts(args)
    # A Ray actor binds itself in-process once running: Ray starts its workers.
    policy = PlacementPolicy.from_env(server_args, launcher=args.launcher)
    placements = plan_engine(server_args, policy=policy, facts=facts, gpus=args.gpus)
    if not is_live(facts.topology):
        assumed = (
            f"planned from the snapshot {facts.topology.root}: assumes numactl there "
            "accepts these options (not probed)"
        )
        placements = tuple(
            (
                dataclasses.replace(p, reasons=(*p.reasons, assumed))
                if p.numactl_args
                else p
            )
            for p in placements
        )
    if args.json:
        rows = [{key: to_dict(p)[key] for key in PLAN_JSON_KEYS} for p in placements]
        print(json.dumps({"ranks": rows}, indent=2))
        return 0
    for p in placements:
        print(describe(p))
    failing = [p.label for p in placements if p.degraded]
    if failing and settings.bind_failure_is_fatal():
        print(
            "SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1: the launch stops at "
            f"{', '.join(failing)} (each is less bound than intended)"
        )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    server_args = PlanArgs.from_cli_args(args)
    launchers = ("mp", "ray") if args.launcher == "both" else (args.launcher,)
    # verify drives sglang's own launch path, which reads its settings from the env.
    for flag in ("--sysfs-root", "--allowed-cpus", "--gpus"):
        if getattr(args, flag[2:].replace("-", "_")) is not None:
            raise UsageError(
                f"{flag} is a planning input that sglang's launch path does not take, "
                f"so verify cannot check it; drop {flag} (use `plan {flag} ...` to see "
                "that plan; a Ray node plans from the SGLANG_SYSFS_ROOT of its raylet)"
            )
    if "mp" in launchers and os.path.realpath(settings.sysfs_root()) != "/sys":
        raise UsageError(
            f"SGLANG_SYSFS_ROOT={settings.sysfs_root()} is not this host's /sys, but "
            "verify starts the ranks here and reads their real binding back; unset it "
            "(use `plan` to see another host's plan)"
        )
    rows: list[dict] = []
    if "mp" in launchers:
        rows += verify_mp(
            server_args, timeout_s=args.timeout, dp_threads=args.dp_threads
        )
    if "ray" in launchers:
        if importlib.util.find_spec("ray") is None:
            raise UsageError("--launcher ray needs Ray (pip install 'ray==2.60.*')")
        from sglang.srt.placement_tools.verify_ray import ray_cluster, verify_ray

        with ray_cluster(server_args, verbose=args.verbose):
            rows += verify_ray(server_args, timeout_s=args.timeout)
    print(
        json.dumps({"ranks": rows}, indent=2) if args.json else format_verify_rows(rows)
    )
    return 0 if all(row["ok"] for row in rows) else 1


def cmd_capture(args: argparse.Namespace) -> int:
    count = capture_sysfs(args.dir, root=args.sysfs_root)
    print(
        f"copied {count} files from {args.sysfs_root} to {args.dir}; "
        f"plan with: {PROG} plan --sysfs-root {args.dir}"
    )
    return 0


def one_line(exc: BaseException) -> str:
    """``exc`` as one printable line: control characters escaped, a long text elided."""
    text = str(exc)
    if not isinstance(exc, (PlacementError, ValueError)) or not text:
        # MemoryError, OverflowError, OSError...: the type says what the text may not.
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    text = "".join(ch if ch.isprintable() else shown(ch, quote=False) for ch in text)
    return elide(text, MAX_MESSAGE_CHARS)


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(
        level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    command = None
    try:
        args = build_parser().parse_args(argv)
        command = args.command
        run = {"plan": cmd_plan, "verify": cmd_verify, "capture": cmd_capture}
        mode = getattr(args, "numa_affinity_mode", None)
        # The flag stands for the setting sglang reads, here and in the ranks started.
        setting = envs.SGLANG_NUMA_AFFINITY_MODE.override(mode) if mode else None
        # The filters in force before are back after.
        with warnings.catch_warnings(), setting or contextlib.nullcontext():
            if not args.verbose:
                # Upstream's import-time warnings (sglang's Ray engine imports its AWQ,
                # GGUF and Triton kernels), not sglang's settings': those are input.
                warnings.filterwarnings("ignore", module=r"(?!sglang\.srt\.environ$)")
            return run[command](args)
    except BAD_INPUT as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        # A rank verify could not check, or sglang refuses to start, fails: status 1.
        return 1 if command == "verify" and isinstance(exc, PlacementError) else 2


if __name__ == "__main__":
    sys.exit(main())
