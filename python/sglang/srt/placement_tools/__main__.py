"""plan | verify | capture: show, check and snapshot where sglang's ranks run."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import logging
import math
import re
import sys
import warnings
from typing import Callable, Optional, Sequence

from sglang.srt.environ import envs
from sglang.srt.placement import settings, topology
from sglang.srt.placement.cpulist import elide, format_cpulist, parse_cpulist, shown
from sglang.srt.placement.facts import FactsHost
from sglang.srt.placement.topology import read_process_affinity, read_topology
from sglang.srt.placement.types import PlacementError, ProcessAffinity
from sglang.srt.placement_tools import PlanArgs, UsageError
from sglang.srt.placement_tools.capture import capture_sysfs
from sglang.srt.placement_tools.engine import (
    ListedGpus,
    check_gpus,
    describe,
    local_ranks,
    plan_engine,
    to_dict,
)
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
            "--set-cpu-affinity",
            action="store_true",
            help="as SGLANG_SET_CPU_AFFINITY=1: each rank a slice of its node's cores",
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


def _plan_host(args: argparse.Namespace, server_args: PlanArgs) -> Optional[FactsHost]:
    """None: this host, as sglang places it; else a snapshot's (all its online CPUs,
    numactl not probed), or this host narrowed to ``--allowed-cpus`` or with the GPUs
    ``--gpus`` names."""
    if args.sysfs_root is None and args.allowed_cpus is None and args.gpus is None:
        return None
    root = args.sysfs_root or topology.SYSFS_ROOT
    tree = read_topology(root, setting="--sysfs-root" if args.sysfs_root else None)
    if args.sysfs_root is None:
        affinity = read_process_affinity()
    else:
        mems = frozenset(n.node_id for n in tree.nodes if n.has_memory)
        affinity = ProcessAffinity(
            tree.online_cpus, mems, "the snapshot (all online CPUs)"
        )
    if args.allowed_cpus is not None:
        cpus = parse_cpulist(args.allowed_cpus, what="--allowed-cpus")
        unknown = cpus - tree.online_cpus
        if not cpus or unknown:
            raise UsageError(
                f"--allowed-cpus={shown(args.allowed_cpus)} names CPU(s) "
                f"{format_cpulist(unknown) or 'none'} that are not online in {root} "
                f"(online: {format_cpulist(tree.online_cpus)})"
            )
        affinity = ProcessAffinity(cpus, affinity.mems, "--allowed-cpus")
    env, gpus = settings.device_env(), None
    if args.gpus is not None:
        ids = [rank.device.index for rank in local_ranks(server_args)]
        gpus = ListedGpus(check_gpus(args.gpus, topology=tree, gpu_ids=ids))
        env = {k: v for k, v in env.items() if k not in settings.VISIBILITY_VARS}
    return FactsHost(
        topology=tree,
        affinity=affinity,
        device=server_args.device,
        numa_nodes=server_args.numa_node,
        env=env,
        runtime=gpus,
    )


def cmd_plan(args: argparse.Namespace) -> int:
    server_args = PlanArgs.from_cli_args(args)
    host = _plan_host(args, server_args)
    # A Ray actor binds itself in-process once running: Ray starts its workers.
    placements = plan_engine(server_args, launcher=args.launcher, host=host)
    if host is not None:
        source = f"the snapshot {args.sysfs_root}" if args.sysfs_root else "this host"
        assumed = (
            f"planned from {source}: assumes numactl there accepts these options "
            "(not probed)"
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
                "that plan)"
            )
    rows: list[dict] = []
    if "mp" in launchers:
        rows += verify_mp(
            server_args,
            timeout_s=args.timeout,
            dp_threads=args.dp_threads,
            verbose=args.verbose,
        )
    if "ray" in launchers:
        if importlib.util.find_spec("ray") is None:
            raise UsageError("--launcher ray needs Ray (pip install 'ray==2.60.*')")
        from sglang.srt.placement_tools.verify_ray import ray_cluster, verify_ray

        with ray_cluster(server_args, verbose=args.verbose):
            rows += verify_ray(
                server_args, timeout_s=args.timeout, verbose=args.verbose
            )
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
    command = snapshot = None
    try:
        args = build_parser().parse_args(argv)
        command = args.command
        snapshot = args.sysfs_root if command == "plan" else None
        run = {"plan": cmd_plan, "verify": cmd_verify, "capture": cmd_capture}
        # The flag stands for the setting sglang reads, here and in the ranks started.
        chosen = getattr(args, "set_cpu_affinity", False)
        setting = envs.SGLANG_SET_CPU_AFFINITY.override(True) if chosen else None
        # The filters in force before are back after.
        with warnings.catch_warnings(), setting or contextlib.nullcontext():
            if not args.verbose:
                # Upstream's import-time warnings (sglang's Ray engine imports its AWQ,
                # GGUF and Triton kernels), not sglang's settings': those are input.
                warnings.filterwarnings("ignore", module=r"(?!sglang\.srt\.environ$)")
            return run[command](args)
    except BAD_INPUT as exc:
        hint = ""
        if snapshot is not None and isinstance(exc, PlacementError):
            hint = f" (a snapshot is made with: {PROG} capture DIR)"
        print(f"error: {one_line(exc)}{hint}", file=sys.stderr)
        # A rank verify could not check, or sglang refuses to start, fails: status 1.
        return 1 if command == "verify" and isinstance(exc, PlacementError) else 2


if __name__ == "__main__":
    sys.exit(main())
