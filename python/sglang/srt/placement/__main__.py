"""python -m sglang.srt.placement plan | verify | capture: show, check and snapshot rank placement."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from typing import Iterator, Optional, Sequence

from sglang.srt.environ import EnvError, envs
from sglang.srt.placement.cpulist import CpuListError, format_cpulist, parse_cpulist
from sglang.srt.placement.types import AFFINITY_MODES, PlacementError, ProcessAffinity, TopologyError
from sglang.srt.server_args import ServerArgs, ServerArgsError

PROG = "python -m sglang.srt.placement"


class UsageError(Exception):
    """Bad input: reported as one line on stderr with exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one clear line, no usage dump
        raise UsageError(f"{self.prog}: {message} (see --help)")


def _add_plan_args(parser: argparse.ArgumentParser, *, launchers: Sequence[str]) -> None:
    ServerArgs.add_cli_args(parser)
    group = parser.add_argument_group("placement")
    group.add_argument("--launcher", choices=launchers, default="mp",
                       help="The launcher the ranks go through (default: mp).")
    group.add_argument("--sysfs-root", default=None,
                       help="Plan from this sysfs tree (a snapshot made by `capture`) instead of this host's /sys; "
                            "nothing is probed on this host. Default: $SGLANG_SYSFS_ROOT or /sys.")
    group.add_argument("--gpus", default=None,
                       help="PCI addresses of the devices, in device-index order, e.g. 0000:17:00.0,0000:65:00.0.")
    group.add_argument("--allowed-cpus", default=None,
                       help="CPUs the ranks may use, e.g. 0-15,32-47 (default: this process's affinity on the live "
                            "host, every online CPU of a snapshot).")
    group.add_argument("--numa-affinity-mode", choices=AFFINITY_MODES, default=None,
                       help="node (all CPUs of the device's node), exclusive (disjoint slices per rank) or socket "
                            "(every node of the device's package). Default: $SGLANG_NUMA_AFFINITY_MODE or node.")
    group.add_argument("--json", action="store_true", help="Print JSON instead of one line per rank.")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    plan = sub.add_parser("plan", help="Show where every rank of this host will run, and why.")
    _add_plan_args(plan, launchers=("mp", "ray"))
    verify = sub.add_parser("verify", help="Start the ranks through the real launcher(s) and read each binding back.")
    _add_plan_args(verify, launchers=("mp", "ray", "both"))
    verify.add_argument("--timeout", type=float, default=120.0, help="Seconds to wait for the ranks (default 120).")
    capture = sub.add_parser("capture", help="Copy the sysfs files placement reads into DIR, for plan --sysfs-root.")
    capture.add_argument("dir", help="A new (or empty) directory.")
    capture.add_argument("--sysfs-root", default="/sys", help="The tree to copy (default /sys).")
    return parser


def _parse_gpus(text: Optional[str]) -> Optional[list[str]]:
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise UsageError(f"--gpus={text!r} is not valid: give PCI addresses separated by commas, "
                         f"e.g. --gpus 0000:17:00.0,0000:65:00.0")
    return parts


def plan_inputs(args: argparse.Namespace) -> dict:
    """The keyword arguments of plan_engine() for these flags: host facts, capabilities, devices."""
    from sglang.srt.placement.resolve import HostCapabilities
    from sglang.srt.placement.topology import read_process_affinity, read_topology

    root = args.sysfs_root or envs.SGLANG_SYSFS_ROOT.get()
    snapshot = os.path.realpath(root) != "/sys"
    topology = read_topology(root)
    if args.allowed_cpus is not None:
        try:
            cpus = parse_cpulist(args.allowed_cpus, what="--allowed-cpus")
        except CpuListError as exc:
            raise UsageError(str(exc)) from None
        unknown = cpus - topology.online_cpus
        if not cpus or unknown:
            raise UsageError(
                f"--allowed-cpus={args.allowed_cpus!r} names CPU(s) {format_cpulist(unknown) or 'none'} that are not "
                f"online in {root} (online: {format_cpulist(topology.online_cpus)})"
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
    capabilities = HostCapabilities.snapshot(root) if snapshot else HostCapabilities.live()
    return dict(
        topology=topology,
        affinity=affinity,
        capabilities=capabilities,
        gpus=_parse_gpus(args.gpus),
        affinity_mode=args.numa_affinity_mode,
    )


def cmd_plan(args: argparse.Namespace) -> int:
    from sglang.srt.placement.resolve import describe, plan_engine

    server_args = ServerArgs.from_cli_args(args)
    placements = plan_engine(server_args, launcher=args.launcher, **plan_inputs(args))
    if args.json:
        keys = ("dp_rank", "pp_rank", "tp_rank", "gpu_id", "pci", "numa_node", "cpus", "mem_policy", "strategy",
                "reasons")
        rows = []
        for p in placements:
            d = p.to_dict()
            rows.append({k: d[k] for k in keys} | {"numactl_args": d["numactl_args"], "mem_nodes": d["mem_nodes"]})
        print(json.dumps({"ranks": rows}, indent=2))
    else:
        for p in placements:
            print(describe(p))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from sglang.srt.placement.verify import format_verify_rows, verify_ranks
    from sglang.srt.scheduler_launch.verify_runners import RUNNERS

    server_args = ServerArgs.from_cli_args(args)
    launchers = ("mp", "ray") if args.launcher == "both" else (args.launcher,)
    if "mp" in launchers:
        root = args.sysfs_root or envs.SGLANG_SYSFS_ROOT.get()
        if os.path.realpath(root) != "/sys":
            raise UsageError(
                f"verify starts the ranks on this host, so it plans from this host's /sys, not {root}; "
                f"use `plan --sysfs-root {root}` to see another host's plan"
            )
        inputs = plan_inputs(args)
    else:
        # Each Ray node plans from its own host facts (the SGLANG_SYSFS_ROOT its raylet has); the driver reads none.
        for flag, value in (("--sysfs-root", args.sysfs_root), ("--allowed-cpus", args.allowed_cpus)):
            if value is not None:
                raise UsageError(
                    f"{flag} describes this host, but with --launcher ray each node plans from its own host facts; "
                    f"drop {flag} (start a node's raylet with SGLANG_SYSFS_ROOT to plan it from another tree)"
                )
        inputs = dict(gpus=_parse_gpus(args.gpus), affinity_mode=args.numa_affinity_mode)
    rows: list[dict] = []
    with contextlib.ExitStack() as stack:
        if "ray" in launchers:
            stack.enter_context(_local_ray_cluster(server_args))
        for launcher in launchers:
            rows.extend(verify_ranks(server_args, launcher=launcher, timeout_s=args.timeout, plan_kwargs=inputs,
                                     runners=RUNNERS))
    if args.json:
        print(json.dumps({"ranks": rows}, indent=2))
    else:
        print(format_verify_rows(rows))
    return 0 if all(row["ok"] for row in rows) else 1


@contextlib.contextmanager
def _local_ray_cluster(server_args: ServerArgs) -> Iterator[None]:
    """Use the Ray cluster this process is connected to, else join the one RAY_ADDRESS names, else start a local
    one; afterwards disconnect from a joined cluster and stop only a cluster started here."""
    try:
        import ray
    except ImportError:
        raise UsageError("--launcher ray needs Ray: pip install 'sglang-placement[ray]'") from None
    if ray.is_initialized():
        yield
        return
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if address:
        ray.init(address=address, configure_logging=False, log_to_driver=False)
    else:
        from sglang.srt.placement.resolve import local_ranks

        num_cpus = max(len(local_ranks(server_args)), len(os.sched_getaffinity(0)))
        # "local": never join a cluster that someone else's `ray start` recorded on this machine.
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, configure_logging=False,
                 log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def cmd_capture(args: argparse.Namespace) -> int:
    from sglang.srt.placement.capture import capture_sysfs

    count = capture_sysfs(args.dir, root=args.sysfs_root)
    print(f"copied {count} files from {args.sysfs_root} to {args.dir}; plan with: "
          f"{PROG} plan --sysfs-root {args.dir}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command == "plan":
            return cmd_plan(args)
        if args.command == "verify":
            return cmd_verify(args)
        return cmd_capture(args)
    except (UsageError, EnvError, ServerArgsError, TopologyError, PlacementError, CpuListError, ValueError,
            FileExistsError, NotADirectoryError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
