"""plan | verify | capture: show, check and snapshot where sglang's ranks run."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import sys
import warnings
from typing import Callable, Iterator, Optional, Sequence

from sglang.srt.placement import settings
from sglang.srt.placement.cpulist import elide, format_cpulist, parse_cpulist, shown
from sglang.srt.placement.modes import AffinityMode
from sglang.srt.placement.types import PlacementError, ProcessAffinity
from sglang.srt.placement_tools import MAX_GPU_ID, PlanArgs, UsageError

PROG = "python -m sglang.srt.placement_tools"
MAX_TIMEOUT_S = 86400.0
MAX_MESSAGE_CHARS = 2000
"""An error line longer than this is cut in the middle."""
BAD_INPUT = (
    PlacementError,
    ValueError,
    OSError,
    ArithmeticError,
    MemoryError,
    RecursionError,
)
"""Bad input of any kind, even what no bound foresaw: one line, exit status 2."""
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
            "--sysfs-root",
            type=_path("--sysfs-root"),
            help="plan from this snapshot (made by `capture`), probing nothing here",
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
            "-v",
            "--verbose",
            action="store_true",
            help="also show upstream sglang's import-time warnings and Ray's notices",
        )
    return parser


def _gpus(text: str, *, topology, server_args: PlanArgs) -> tuple[str, ...]:
    """Bounded before it is parsed; ``check_gpus`` refuses what the host lacks."""
    from sglang.srt.placement_tools.engine import check_gpus, local_ranks

    parts = text.split(",")
    if len(parts) > MAX_GPU_ID + 1 or not all(part.strip() for part in parts):
        raise UsageError(
            f"--gpus={shown(text)} is not valid: give up to {MAX_GPU_ID + 1} PCI "
            "addresses separated by commas, e.g. --gpus 0000:17:00.0,0000:65:00.0"
        )
    ids = [rank.gpu_id for rank in local_ranks(server_args) if rank.gpu_id is not None]
    return check_gpus(parts, topology=topology, gpu_ids=ids)


def cmd_plan(args: argparse.Namespace) -> int:
    from sglang.srt.placement.policy import PlacementPolicy
    from sglang.srt.placement.resolve import HostCapabilities, HostFacts
    from sglang.srt.placement.topology import read_process_affinity, read_topology
    from sglang.srt.placement_tools.engine import (
        describe,
        plan_engine,
        snapshot_capabilities,
        to_dict,
    )

    server_args = PlanArgs.from_cli_args(args)
    root = args.sysfs_root or settings.sysfs_root()
    if args.sysfs_root is None and not os.path.isdir(root):
        raise UsageError(
            f"SGLANG_SYSFS_ROOT={shown(root)} is not a directory: unset it, or set it "
            f"to /sys or to a snapshot made with `{PROG} capture DIR`"
        )
    snapshot = os.path.realpath(root) != "/sys"
    topology = read_topology(
        root, setting="--sysfs-root" if args.sysfs_root else "SGLANG_SYSFS_ROOT"
    )
    if snapshot:
        mems = frozenset(n.node_id for n in topology.nodes if n.has_memory)
        source = "the snapshot (all online CPUs)"
        affinity = ProcessAffinity(topology.online_cpus, mems, source)
        capabilities = snapshot_capabilities(root)
    else:
        affinity, capabilities = read_process_affinity(), HostCapabilities.live()
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
    gpus = None
    if args.gpus is not None:
        gpus = _gpus(args.gpus, topology=topology, server_args=server_args)
    # A Ray actor binds itself in-process once running: Ray starts its workers.
    policy = PlacementPolicy.from_env(server_args, launcher=args.launcher)
    if args.numa_affinity_mode is not None:
        policy = dataclasses.replace(policy, affinity_mode=args.numa_affinity_mode)
    facts = HostFacts(topology=topology, affinity=affinity, capabilities=capabilities)
    placements = plan_engine(server_args, policy=policy, facts=facts, gpus=gpus)
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
    from sglang.srt.placement_tools.verify import format_verify_rows, verify_mp

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
    if args.numa_affinity_mode is not None:
        # The flag stands for the setting sglang reads, here and in the spawned ranks.
        os.environ["SGLANG_NUMA_AFFINITY_MODE"] = args.numa_affinity_mode
    rows: list[dict] = []
    if "mp" in launchers:
        rows += verify_mp(
            server_args, timeout_s=args.timeout, dp_threads=args.dp_threads
        )
    if "ray" in launchers:
        with _ray_cluster(server_args, verbose=args.verbose):
            from sglang.srt.placement_tools.verify_ray import verify_ray

            rows += verify_ray(server_args, timeout_s=args.timeout)
    print(
        json.dumps({"ranks": rows}, indent=2) if args.json else format_verify_rows(rows)
    )
    return 0 if all(row["ok"] for row in rows) else 1


@contextlib.contextmanager
def _ray_cluster(server_args: PlanArgs, *, verbose: bool) -> Iterator[None]:
    """The connected Ray cluster, else RAY_ADDRESS's, else a new local one; unless
    ``verbose``, without Ray's notices (such as token authentication's) below errors."""
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
    from sglang.srt.placement_tools.engine import ENGINE_POLICY_VARS

    env = {k: os.environ[k] for k in ENGINE_POLICY_VARS if k in os.environ}
    options = dict(configure_logging=False, log_to_driver=False)
    options["runtime_env"] = {"env_vars": env} if env else None
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if not address:
        from sglang.srt.placement_tools.engine import local_ranks

        # "local": never join a cluster that someone else's `ray start` recorded on this
        # machine. RayEngine asks one GPU per scheduler actor whatever the device: a CPU
        # engine needs GPUs declared.
        ranks = len(local_ranks(server_args))
        options.update(
            num_cpus=max(ranks, len(os.sched_getaffinity(0))),
            num_gpus=ranks if server_args.device == "cpu" else None,
            include_dashboard=False,
        )
    ray_logger = logging.getLogger("ray")  # what `import ray` set: INFO
    level = ray_logger.level
    if not verbose:
        ray_logger.setLevel(logging.ERROR)
    try:
        ray.init(address=address or "local", **options)
        try:
            yield
        finally:
            ray.shutdown()
    finally:
        ray_logger.setLevel(level)


def cmd_capture(args: argparse.Namespace) -> int:
    from sglang.srt.placement_tools.capture import capture_sysfs

    count = capture_sysfs(args.dir, root=args.sysfs_root)
    print(
        f"copied {count} files from {args.sysfs_root} to {args.dir}; "
        f"plan with: {PROG} plan --sysfs-root {args.dir}"
    )
    return 0


@contextlib.contextmanager
def _upstream_warnings(shown: bool) -> Iterator[None]:
    """Unless ``shown``, warnings raised in this process while the command runs are
    ignored, such as upstream's import-time ones (sglang's Ray engine imports its AWQ,
    GGUF and Triton kernels); the filters in force before are back afterwards."""
    if shown:
        yield
        return
    with warnings.catch_warnings():
        # All but sglang's settings': a value it cannot read is about the tool's input.
        warnings.filterwarnings("ignore", module=r"(?!sglang\.srt\.environ$)")
        yield


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
        with _upstream_warnings(args.verbose):
            return run[command](args)
    except BAD_INPUT as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        # A rank verify could not check, or sglang refuses to start, fails: status 1.
        return 1 if command == "verify" and isinstance(exc, PlacementError) else 2


if __name__ == "__main__":
    sys.exit(main())
