"""python -m sglang.srt.placement_tools plan | verify | capture: show, check and snapshot rank placement."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import sys
from typing import Callable, Iterator, Optional, Sequence

from sglang.srt.placement import settings
from sglang.srt.placement.cpulist import (
    CpuListError,
    elide,
    format_cpulist,
    parse_cpulist,
    shown,
)
from sglang.srt.placement.types import AFFINITY_MODES, PlacementError, ProcessAffinity
from sglang.srt.placement_tools.plan_args import PlanArgs

PROG = "python -m sglang.srt.placement_tools"

MAX_RANKS = 65536
"""The most ranks one engine may have (--tp-size x --pp-size x --dp-size), and so each size flag's ceiling."""
MAX_GPU_ID = 4095
"""Far above the accelerator count of any host."""
MAX_NUMA_NODES = 1024
"""Linux's MAX_NUMNODES at its largest (CONFIG_NODES_SHIFT=10): node ids run from 0 to 1023."""
MAX_TIMEOUT_S = 86400.0
"""verify waits for its ranks at most a day."""

INT_FLAGS: dict[str, tuple[str, int, int]] = {
    "tp_size": ("--tp-size", 1, MAX_RANKS),
    "pp_size": ("--pp-size", 1, MAX_RANKS),
    "dp_size": ("--dp-size", 1, MAX_RANKS),
    "nnodes": ("--nnodes", 1, MAX_RANKS),
    "node_rank": ("--node-rank", 0, MAX_RANKS - 1),
    "base_gpu_id": ("--base-gpu-id", 0, MAX_GPU_ID),
    "gpu_id_step": ("--gpu-id-step", 1, MAX_GPU_ID),
    "numa_node": ("--numa-node", 0, MAX_NUMA_NODES - 1),
}
"""Each integer flag's name in messages and accepted range, by its dest; any other one gets OTHER_INT_RANGE."""
OTHER_INT_RANGE = (-(2**31 - 1), 2**31 - 1)
MAX_MESSAGE_CHARS = 2000
"""An error line longer than this is cut in the middle."""

_INT_RE = re.compile(r"[+-]?[0-9]+")
_FLOAT_RE = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


class UsageError(Exception):
    """Bad input: reported as one line on stderr with exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one clear line, no usage dump
        raise UsageError(f"{self.prog}: {message} (see --help)")


def bounded_int(flag: str, lowest: int, highest: int) -> Callable[[str], int]:
    """An argparse ``type=``: ASCII decimal digits (no ``٣``, ``1_0`` or ``0x10``) from ``lowest`` to ``highest``."""

    def parse(text: str) -> int:
        word = text.strip()
        if _INT_RE.fullmatch(word) is None:
            raise argparse.ArgumentTypeError(
                f"invalid int value: {shown(text)} ({flag} takes an integer from {lowest} to {highest})"
            )
        # Length first: int() of a 100,000-digit string is slow (and refused past 4300 digits).
        if len(word.lstrip("+-").lstrip("0")) > len(
            str(max(abs(lowest), abs(highest)))
        ) or not (lowest <= int(word) <= highest):
            raise argparse.ArgumentTypeError(
                f"{flag}={shown(word, quote=False)} is not valid: it must be an integer from {lowest} to {highest}"
            )
        return int(word)

    parse.__name__ = "int"
    return parse


def bounded_seconds(flag: str, highest: float) -> Callable[[str], float]:
    """An argparse ``type=``: a finite number of seconds above 0 and at most ``highest`` (no nan, inf or 1e400)."""

    def parse(text: str) -> float:
        word = text.strip()
        value = float(word) if _FLOAT_RE.fullmatch(word) else math.nan
        if not (math.isfinite(value) and 0 < value <= highest):
            raise argparse.ArgumentTypeError(
                f"{flag}={shown(word, quote=False)} is not valid: it must be a number of seconds above 0 and at most "
                f"{highest:g}"
            )
        return value

    parse.__name__ = "float"
    return parse


def path_arg(flag: str) -> Callable[[str], str]:
    """An argparse ``type=`` for a path: not empty, and no NUL byte (which no system call takes)."""

    def parse(text: str) -> str:
        if not text or "\0" in text:
            raise argparse.ArgumentTypeError(
                f"{flag}={shown(text)} is not valid: give a path{' (a path cannot hold a NUL byte)' if text else ''}"
            )
        return text

    parse.__name__ = "path"
    return parse


def _bound_integer_flags(parser: argparse.ArgumentParser) -> None:
    """Give every ``type=int`` flag (PlanArgs' included, which follow upstream's names) a bounded type."""
    for (
        action
    ) in parser._actions:  # argparse has no public way to list a parser's arguments
        if action.type is int:
            name = action.option_strings[-1] if action.option_strings else action.dest
            flag, lowest, highest = INT_FLAGS.get(action.dest) or (
                name,
                *OTHER_INT_RANGE,
            )
            action.type = bounded_int(flag, lowest, highest)


def _add_plan_args(
    parser: argparse.ArgumentParser, *, launchers: Sequence[str]
) -> None:
    PlanArgs.add_cli_args(parser)
    _bound_integer_flags(parser)
    group = parser.add_argument_group("placement")
    group.add_argument(
        "--launcher",
        choices=launchers,
        default="mp",
        help="The launcher the ranks go through (default: mp).",
    )
    group.add_argument(
        "--sysfs-root",
        default=None,
        type=path_arg("--sysfs-root"),
        help="Plan from this sysfs tree (a snapshot made by `capture`) instead of this host's /sys; "
        "nothing is probed on this host. Default: $SGLANG_SYSFS_ROOT or /sys.",
    )
    group.add_argument(
        "--gpus",
        default=None,
        help="PCI addresses of the devices, in device-index order, e.g. 0000:17:00.0,0000:65:00.0.",
    )
    group.add_argument(
        "--allowed-cpus",
        default=None,
        help="CPUs the ranks may use, e.g. 0-15,32-47 (default: this process's affinity on the live "
        "host, every online CPU of a snapshot).",
    )
    group.add_argument(
        "--numa-affinity-mode",
        choices=AFFINITY_MODES,
        default=None,
        help="node (all CPUs of the device's node), socket (every node of the device's "
        "package), exclusive (the device's slice of its node's cores) or core-complex (one "
        "L3 group of its node). Default: $SGLANG_NUMA_AFFINITY_MODE or node.",
    )
    group.add_argument(
        "--json", action="store_true", help="Print JSON instead of one line per rank."
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    plan = sub.add_parser(
        "plan", help="Show where every rank of this host will run, and why."
    )
    _add_plan_args(plan, launchers=("mp", "ray"))
    verify = sub.add_parser(
        "verify",
        help="Start the ranks through the real launcher(s) and read each binding back.",
    )
    _add_plan_args(verify, launchers=("mp", "ray", "both"))
    verify.add_argument(
        "--dp-threads",
        action="store_true",
        help="Start each dp rank's schedulers from its own thread, as sglang's data-parallel "
        "controller does (default: one after another, as the engine does).",
    )
    verify.add_argument(
        "--timeout",
        type=bounded_seconds("--timeout", MAX_TIMEOUT_S),
        default=120.0,
        help=f"Seconds to wait for the ranks, above 0 and at most {MAX_TIMEOUT_S:g} (default 120).",
    )
    capture = sub.add_parser(
        "capture",
        help="Copy the sysfs files placement reads into DIR, for plan --sysfs-root.",
    )
    capture.add_argument(
        "dir",
        metavar="DIR",
        type=path_arg("DIR"),
        help="A new (or empty) directory of this user.",
    )
    capture.add_argument(
        "--sysfs-root",
        default="/sys",
        type=path_arg("--sysfs-root"),
        help="The tree to copy (default /sys).",
    )
    return parser


def _parse_gpus(text: Optional[str]) -> Optional[list[str]]:
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise UsageError(
            f"--gpus={shown(text)} is not valid: give PCI addresses separated by commas, "
            f"e.g. --gpus 0000:17:00.0,0000:65:00.0"
        )
    if len(parts) > MAX_GPU_ID + 1:
        raise UsageError(
            f"--gpus={shown(text)} lists {len(parts)} devices, more than the limit of {MAX_GPU_ID + 1}"
        )
    return parts


def plan_inputs(args: argparse.Namespace) -> dict:
    """The keyword arguments of plan_engine() for these flags: host facts and devices."""
    from sglang.srt.placement.plan import HostFacts
    from sglang.srt.placement.strategy import HostCapabilities
    from sglang.srt.placement.topology import read_process_affinity, read_topology

    root = args.sysfs_root or settings.sysfs_root()
    if args.sysfs_root is None and not os.path.isdir(root):
        raise UsageError(
            f"SGLANG_SYSFS_ROOT={shown(root)} is not a directory: unset it, or set it to /sys or to a snapshot made "
            f"with `{PROG} capture DIR`"
        )
    snapshot = os.path.realpath(root) != "/sys"
    topology = read_topology(
        root, setting="--sysfs-root" if args.sysfs_root else "SGLANG_SYSFS_ROOT"
    )
    if args.allowed_cpus is not None:
        try:
            cpus = parse_cpulist(args.allowed_cpus, what="--allowed-cpus")
        except CpuListError as exc:
            raise UsageError(str(exc)) from None
        unknown = cpus - topology.online_cpus
        if not cpus or unknown:
            raise UsageError(
                f"--allowed-cpus={shown(args.allowed_cpus)} names CPU(s) {format_cpulist(unknown) or 'none'} that are "
                f"not online in {root} (online: {format_cpulist(topology.online_cpus)})"
            )
        mems = frozenset(n.node_id for n in topology.nodes if n.has_memory)
        if not snapshot:
            mems = read_process_affinity().mems
        affinity = ProcessAffinity(cpus=cpus, mems=mems, source="--allowed-cpus")
    elif snapshot:
        affinity = ProcessAffinity(
            cpus=topology.online_cpus,
            mems=frozenset(n.node_id for n in topology.nodes if n.has_memory),
            source="the snapshot (all online CPUs)",
        )
    else:
        affinity = read_process_affinity()
    capabilities = (
        HostCapabilities.snapshot(root) if snapshot else HostCapabilities.live()
    )
    gpus = _parse_gpus(args.gpus)
    if gpus is not None:
        # A typo must be an error here, not a rank that the plan shows unbound.
        from sglang.srt.placement.devices import parse_gpus_option

        for address in parse_gpus_option(gpus):
            if topology.pci_device(address) is None:
                raise UsageError(
                    f"--gpus: {address} is not among the {len(topology.pci_devices)} PCI devices read from {root}; "
                    f"check the address with `lspci -D`"
                )
    return dict(
        facts=HostFacts(
            topology=topology, affinity=affinity, capabilities=capabilities
        ),
        gpus=gpus,
        affinity_mode=args.numa_affinity_mode,
    )


PLAN_JSON_KEYS = (
    "dp_rank pp_rank tp_rank gpu_id pci numa_node cpus mem_policy strategy reasons "
    "numactl_args mem_nodes"
).split()
"""What ``plan --json`` prints of each rank's placement, in this order."""


def cmd_plan(args: argparse.Namespace) -> int:
    from sglang.srt.placement.plan import plan_engine
    from sglang.srt.placement.policy import PlacementPolicy
    from sglang.srt.placement.resolve import describe

    server_args = PlanArgs.from_cli_args(args)
    inputs = plan_inputs(args)
    # A Ray actor binds itself in-process once running: Ray starts its workers.
    policy = PlacementPolicy.from_env(
        server_args,
        launcher=args.launcher,
        affinity_mode=inputs.pop("affinity_mode"),
        exec_supported=args.launcher != "ray",
    )
    placements = plan_engine(server_args, policy=policy, **inputs)
    if args.json:
        rows = [{key: p.to_dict()[key] for key in PLAN_JSON_KEYS} for p in placements]
        print(json.dumps({"ranks": rows}, indent=2))
    else:
        for p in placements:
            print(describe(p))
        failing = [p.label for p in placements if p.warning]
        if failing and settings.bind_failure_is_fatal():
            print(
                f"SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1: the launch stops at {', '.join(failing)} "
                "(each is less bound than intended)"
            )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from sglang.srt.placement_tools.verify import format_verify_rows, verify_mp

    server_args = PlanArgs.from_cli_args(args)
    launchers = ("mp", "ray") if args.launcher == "both" else (args.launcher,)
    # verify drives sglang's own launch path, which takes its settings from the environment, not from flags.
    for flag, value in (
        ("--sysfs-root", args.sysfs_root),
        ("--allowed-cpus", args.allowed_cpus),
        ("--gpus", args.gpus),
    ):
        if value is not None:
            raise UsageError(
                f"{flag} is a planning input that sglang's launch path does not take, so verify cannot check "
                f"it; drop {flag} (use `plan {flag} ...` to see that plan; a Ray node plans from the "
                f"SGLANG_SYSFS_ROOT of its raylet)"
            )
    if os.path.realpath(settings.sysfs_root()) != "/sys" and "mp" in launchers:
        raise UsageError(
            f"SGLANG_SYSFS_ROOT={settings.sysfs_root()} is not this host's /sys, but verify starts the ranks here "
            "and reads their real binding back; unset it (use `plan` to see another host's plan)"
        )
    if args.numa_affinity_mode is not None:
        # The flag stands for the setting sglang reads; this process's spawns and plan both see it.
        os.environ["SGLANG_NUMA_AFFINITY_MODE"] = args.numa_affinity_mode
    rows: list[dict] = []
    with contextlib.ExitStack() as stack:
        for launcher in launchers:
            if launcher == "mp":
                rows.extend(
                    verify_mp(
                        server_args, timeout_s=args.timeout, dp_threads=args.dp_threads
                    )
                )
            else:
                from sglang.srt.placement_tools.verify_ray import verify_ray

                stack.enter_context(_local_ray_cluster(server_args))
                rows.extend(verify_ray(server_args, timeout_s=args.timeout))
    if args.json:
        print(json.dumps({"ranks": rows}, indent=2))
    else:
        print(format_verify_rows(rows))
    return 0 if all(row["ok"] for row in rows) else 1


@contextlib.contextmanager
def _local_ray_cluster(server_args: PlanArgs) -> Iterator[None]:
    """Use the Ray cluster this process is connected to, else join the one RAY_ADDRESS names, else start a local
    one; afterwards disconnect from a joined cluster and stop only a cluster started here.
    """
    try:
        import ray
    except ImportError:
        raise UsageError(
            "--launcher ray needs Ray (pip install 'ray==2.60.*')"
        ) from None
    if ray.is_initialized():
        yield
        return
    # sglang's actors read the engine's settings where they run: hand them to the
    # job's workers, as an operator hands them to RayEngine's.
    names = [name for name in settings.ENGINE_POLICY_VARS if name in os.environ]
    job = {"env_vars": {name: os.environ[name] for name in names}} if names else None
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if address:
        ray.init(
            address=address,
            runtime_env=job,
            configure_logging=False,
            log_to_driver=False,
        )
    else:
        from sglang.srt.placement.ranks import local_ranks

        ranks = len(local_ranks(server_args))
        num_cpus = max(ranks, len(os.sched_getaffinity(0)))
        # RayEngine asks one GPU per scheduler actor whatever the device: a CPU engine needs GPUs declared.
        num_gpus = ranks if server_args.device == "cpu" else None
        # "local": never join a cluster that someone else's `ray start` recorded on this machine.
        ray.init(
            address="local",
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            include_dashboard=False,
            runtime_env=job,
            configure_logging=False,
            log_to_driver=False,
        )
    try:
        yield
    finally:
        ray.shutdown()


def cmd_capture(args: argparse.Namespace) -> int:
    from sglang.srt.placement_tools.capture import capture_sysfs

    count = capture_sysfs(args.dir, root=args.sysfs_root)
    print(
        f"copied {count} files from {args.sysfs_root} to {args.dir}; plan with: "
        f"{PROG} plan --sysfs-root {args.dir}"
    )
    return 0


def _check_world_size(args: argparse.Namespace) -> None:
    ranks = args.tp_size * args.pp_size * args.dp_size
    if ranks > MAX_RANKS:
        raise UsageError(
            f"--tp-size={args.tp_size} x --pp-size={args.pp_size} x --dp-size={args.dp_size} = {ranks} ranks is "
            f"above the limit of {MAX_RANKS} ranks per engine"
        )


def one_line(exc: BaseException) -> str:
    """``exc`` as one printable line: control characters escaped, a very long text cut in the middle."""
    text = str(exc)
    if not isinstance(exc, (UsageError, PlacementError, ValueError)) or not text:
        # MemoryError, RecursionError, OverflowError, OSError: the type says what the text alone may not.
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return elide(
        "".join(ch if ch.isprintable() else shown(ch, quote=False) for ch in text),
        MAX_MESSAGE_CHARS,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(
        level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command == "plan":
            _check_world_size(args)
            return cmd_plan(args)
        if args.command == "verify":
            _check_world_size(args)
            try:
                return cmd_verify(args)
            except RuntimeError as exc:
                from sglang.srt.placement_tools.verify import VerifyError

                if not isinstance(exc, (VerifyError, PlacementError)):
                    raise
                # A rank that could not be checked, or that sglang's launch path
                # refuses to start (SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1), fails the
                # check: one line, status 1.
                print(f"error: {one_line(exc)}", file=sys.stderr)
                return 1
        return cmd_capture(args)
    # Bad input of any kind - a flag, an environment variable or a file - is one line and exit status 2:
    # ValueError covers SettingError, PlanArgsError, CpuListError, TopologyError and UnicodeError; OSError the
    # file errors; ArithmeticError OverflowError; MemoryError and RecursionError what no bound foresaw.
    except (
        UsageError,
        PlacementError,
        ValueError,
        OSError,
        ArithmeticError,
        MemoryError,
        RecursionError,
    ) as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
