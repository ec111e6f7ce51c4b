"""plan | verify | capture: show, check and snapshot where sglang's scheduler ranks
run. Bad input exits 2 with one line naming the flag, variable or file."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import warnings
from typing import Optional, Sequence

from sglang.srt.placement_tools.plan import UsageError

PROG = "python -m sglang.srt.placement_tools"
MAX_RANKS = 4096


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        raise UsageError(f"{self.prog}: error: {message} (see --help)")


def _int(flag: str, lowest: int):
    def parse(text: str) -> int:
        word = text.strip()
        if not (word.isascii() and word.isdigit()) or not lowest <= int(word) < 1 << 20:
            raise argparse.ArgumentTypeError(
                f"{flag}={text!r} is not valid: give an integer from {lowest}, "
                f"e.g. {flag} {max(lowest, 1)}"
            )
        return int(word)

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 86400:
        raise argparse.ArgumentTypeError(
            f"--timeout={text!r} is not valid: give seconds above 0, at most 86400"
        )
    return value


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    """sglang's own flags for what placement reads."""
    for names, lowest in (
        (("--tp-size", "--tensor-parallel-size", "--tp"), 1),
        (("--pp-size", "--pipeline-parallel-size"), 1),
        (("--dp-size", "--data-parallel-size", "--dp"), 1),
        (("--nnodes",), 1),
        (("--node-rank",), 0),
        (("--base-gpu-id",), 0),
        (("--gpu-id-step",), 1),
    ):
        dest = names[0][2:].replace("-", "_")
        parser.add_argument(*names, dest=dest, type=_int(names[0], lowest))
        parser.set_defaults(**{dest: lowest})
    parser.add_argument("--numa-node", type=_int("--numa-node", 0), nargs="+")
    parser.add_argument("--device", choices=("cuda", "xpu", "cpu"), default="cuda")
    parser.add_argument(
        "--set-cpu-affinity",
        action="store_true",
        help="as SGLANG_SET_CPU_AFFINITY=1: each GPU's rank a slice of its node",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("-v", "--verbose", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    plan = sub.add_parser("plan", help="where each rank of this host runs, and why")
    _engine_flags(plan)
    plan.add_argument("--launcher", choices=("mp", "ray"), default="mp")
    plan.add_argument("--sysfs-root", metavar="DIR", help="plan the host of a capture")
    plan.add_argument("--gpus", metavar="PCI,...", help="PCI address per device index")
    plan.add_argument("--allowed-cpus", metavar="LIST", help="the CPUs ranks may use")
    plan.add_argument("--in-namespace", help=argparse.SUPPRESS)
    verify = sub.add_parser("verify", help="start probe ranks, read bindings back")
    _engine_flags(verify)
    verify.add_argument("--launcher", choices=("mp", "ray", "both"), default="mp")
    verify.add_argument("--timeout", type=_seconds, default=300.0, metavar="S")
    capture = sub.add_parser("capture", help="copy the sysfs files placement reads")
    capture.add_argument("dir", metavar="DIR")
    capture.add_argument("--sysfs-root", metavar="DIR", default="/sys")
    capture.add_argument("-v", "--verbose", action="store_true")
    return parser


def _check(args: argparse.Namespace) -> None:
    if args.command == "capture":
        return
    ranks = args.tp_size * args.pp_size * args.dp_size
    if ranks > MAX_RANKS:
        raise UsageError(
            f"--tp-size x --pp-size x --dp-size = {ranks} ranks: at most {MAX_RANKS}"
        )
    if args.node_rank >= args.nnodes:
        raise UsageError(
            f"--node-rank {args.node_rank} is not valid with --nnodes {args.nnodes}: "
            f"node ranks run from 0 to {args.nnodes - 1}"
        )
    if (args.tp_size * args.pp_size) % args.nnodes:
        raise UsageError(
            f"--tp-size {args.tp_size} x --pp-size {args.pp_size} ranks cannot be "
            f"split evenly over --nnodes {args.nnodes}"
        )
    if args.set_cpu_affinity:
        os.environ["SGLANG_SET_CPU_AFFINITY"] = "1"


class _Once(logging.Filter):
    """Each message once (sglang repeats some for every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.getMessage())
        fresh = key not in self.seen
        self.seen.add(key)
        return fresh


def _quiet(verbose: bool) -> None:
    """Unless ``verbose``: no import-time warnings (here and in the ranks), and
    sglang's warnings only, each once."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(_Once())
    if not verbose:
        warnings.simplefilter("ignore")
        os.environ.setdefault("PYTHONWARNINGS", "ignore")


def _other_host(args: argparse.Namespace, root: Optional[str], plan) -> tuple:
    """(GPUs, allowed CPUs, notes) of the host planned, checked; (None, None, ())
    where it is this one as it is."""
    gpus, allowed, notes = None, None, ()
    if args.gpus is not None:
        gpus = plan.parse_gpus(args.gpus, root or "/sys")
    elif root is not None and args.device == "cuda":
        gpus = plan.snapshot_gpus(root)
    usable = os.sched_getaffinity(0)
    if root is not None:
        online = plan.read_text(root, "devices/system/cpu/online")
        usable = allowed = plan.parse_cpulist(online, what=f"{root} online CPUs")
        notes = (f"planned from {args.sysfs_root}: numactl there not probed",)
    if args.allowed_cpus is not None:
        allowed = plan.parse_cpulist(args.allowed_cpus, what="--allowed-cpus")
        if not allowed <= usable:
            where = f"online in {root}" if root else "this process's"
            raise UsageError(
                f"--allowed-cpus={args.allowed_cpus}: CPUs "
                f"{plan.format_cpulist(allowed - usable)} are not among the "
                f"{where} CPUs {plan.format_cpulist(usable)}"
            )
    return gpus, allowed, notes


def cmd_plan(args: argparse.Namespace, argv: list) -> int:
    from sglang.srt.placement_tools import plan

    root = os.path.abspath(args.sysfs_root) if args.sysfs_root else None
    if root is None and args.in_namespace is not None:
        raise UsageError("--in-namespace is internal to --sysfs-root")
    if root is not None:
        plan.check_snapshot(root)
        if args.device == "xpu":
            raise UsageError("--sysfs-root plans --device cuda or cpu, not xpu")
    gpus, allowed, notes = _other_host(args, root, plan)
    ray = args.launcher == "ray"
    ranks = plan.node_ranks(args, args.node_rank, ray=ray)
    ranks = plan.ray_gpu_ids(ranks) if ray else ranks
    if gpus is not None and args.device == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        count = len(gpus) if ray or visible is None else len(visible.split(","))
        top = max(rank.gpu_id for rank in ranks)
        if top >= count:
            name = "--gpus" if args.gpus is not None else f"--sysfs-root {root}"
            raise UsageError(
                f"{name}: {len(gpus)} GPU(s) ({','.join(gpus) or 'none'}) "
                f"{'and CUDA_VISIBLE_DEVICES ' if visible else ''}give device "
                f"indexes up to {count - 1}, but a rank uses GPU {top}"
            )
    if root is not None:
        if args.in_namespace is None:  # again, where the snapshot is /sys
            return subprocess.run(plan.namespace_argv(argv)).returncode
        plan.mount_snapshot(root, args.in_namespace)
    if gpus is not None or allowed is not None:
        plan.stand_in_host(gpus=gpus, allowed=allowed, probe=root is None)
    server_args = plan.server_args_for(args)
    rows = []
    for rank in ranks:
        try:
            rows.append(
                plan.plan_rank(server_args, rank, launcher=args.launcher, notes=notes)
            )
        except ValueError as e:
            raise UsageError(f"[{rank.label}] {e}") from None
    if args.json:
        print(json.dumps({"ranks": rows}, indent=2))
    else:
        print("\n".join(map(plan.format_plan_row, rows)))
    return 0


def cmd_verify(args: argparse.Namespace, argv: list) -> int:
    from sglang.srt.placement_tools import plan, verify

    level = "info" if args.verbose else "error"
    server_args = plan.server_args_for(args, log_level=level)
    launchers = ("mp", "ray") if args.launcher == "both" else (args.launcher,)
    for launcher in launchers:  # bad input shows here, before any rank starts
        for rank in plan.node_ranks(args, args.node_rank, ray=launcher == "ray"):
            try:
                plan.plan_rank(server_args, rank, launcher=launcher)
            except ValueError as e:
                raise UsageError(f"[{rank.label}] {e}") from None
    rows = []
    try:
        if "mp" in launchers:
            rows += verify.verify_mp(args, server_args, timeout=args.timeout)
        if "ray" in launchers:
            try:
                import ray  # noqa: F401
            except ImportError:
                raise UsageError("--launcher ray needs Ray (pip install ray)") from None
            rows += verify.verify_ray(
                args, server_args, timeout=args.timeout, verbose=args.verbose
            )
    except verify.ProbeError as e:
        print(f"{PROG} verify: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"ranks": rows}, indent=2))
    else:
        print("\n".join(map(verify.format_verify_row, rows)))
    return 0 if all(row["ok"] for row in rows) else 1


def cmd_capture(args: argparse.Namespace, argv: list) -> int:
    from sglang.srt.placement_tools.capture import capture

    count = capture(args.dir, root=args.sysfs_root)
    print(
        f"copied {count} files from {args.sysfs_root} to {args.dir}; plan with: "
        f"{PROG} plan --sysfs-root {args.dir}"
    )
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = None
    try:
        args = build_parser().parse_args(argv)
        _check(args)
        _quiet(args.verbose)
        command = {"plan": cmd_plan, "verify": cmd_verify, "capture": cmd_capture}
        return command[args.command](args, argv)
    except UsageError as e:
        text = " ".join(str(e).split())
        command = f"{PROG} {args.command}" if args else PROG
        prefix = "" if text.startswith(PROG) else f"{command}: error: "
        print(f"{prefix}{text}", file=sys.stderr)
        return 2
    except Exception as e:  # the core refused (e.g. SGLANG_CRASH_ON_NUMA_BIND_FAILURE)
        if args is None or args.verbose:
            raise
        print(f"{PROG} {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
