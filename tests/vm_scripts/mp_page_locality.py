"""Inside a multi-NUMA VM: plan the rank of a PCI device, launch it through the multiprocessing launcher, verify.

Plain Python only (no torch): under emulation every import is slow. The plan is
made first, as an engine would; then the launching process re-executes itself
pinned to ``--start-cpu`` so that an unbound start lands on that CPU's node (the
hard case for the in-process strategy, whose early pages must be migrated).
Each ``--strategies`` entry launches the planned rank once with that strategy
through ``run_ranks_mp`` and the verify probe. Prints one JSON object on its
last line of stdout: {"plan": [...], "rows": [...]}.

    python tests/vm_scripts/mp_page_locality.py --gpus 0000:81:00.0 [--strategies exec,in-process]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "harness"))
import sglang_light  # noqa: E402,F401  (first: placement without sglang's own __init__)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", required=True, help="PCI address(es) of the rank's device(s)")
    parser.add_argument("--strategies", default="exec,in-process")
    parser.add_argument("--start-cpu", type=int, default=0)
    parser.add_argument("--plan-json", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    from sglang.srt.placement.types import ProcessPlacement
    from sglang.srt.placement.engine_args import EngineArgs

    server_args = EngineArgs(tp_size=len(args.gpus.split(",")))
    if args.plan_json is None:
        from sglang.srt.placement.resolve import plan_engine

        plan = plan_engine(server_args, launcher="mp", gpus=args.gpus.split(","))
        plan_json = json.dumps([p.to_dict() for p in plan])
        os.sched_setaffinity(0, {args.start_cpu})
        os.execv(sys.executable, [sys.executable, *sys.argv, "--plan-json", plan_json])

    from sglang.srt.placement.verify import format_verify_rows, verify_ranks
    from sglang.srt.scheduler_launch.verify_runners import run_mp

    plan = [ProcessPlacement.from_dict(d) for d in json.loads(args.plan_json)]
    rows = []
    for strategy in args.strategies.split(","):
        if strategy == "exec":
            placements = plan
        else:
            placements = [p.replace(strategy=strategy, numactl_args=()) for p in plan]
        rows.extend(verify_ranks(server_args, launcher="mp", placements=placements, timeout_s=240,
                                 runners={"mp": run_mp}))
    print(format_verify_rows(rows), file=sys.stderr)
    print(json.dumps({"plan": [p.to_dict() for p in plan], "parent_cpus": sorted(os.sched_getaffinity(0)), "rows": rows}))


if __name__ == "__main__":
    main()
