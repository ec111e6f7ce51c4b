"""The runners ``verify`` starts ranks with: each launcher core with the placement probe as its target.

The CLI hands these to :func:`sglang.srt.placement.verify.verify_ranks`, so the
placement package itself never imports a launcher.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from sglang.srt.placement.types import ProcessPlacement
from sglang.srt.placement.verify import probe_target


def run_mp(server_args: Any, *, placements: Optional[Sequence[ProcessPlacement]], timeout_s: float,
           plan_kwargs: Mapping[str, Any]) -> list:
    from sglang.srt.scheduler_launch.mp import run_ranks_mp

    if placements is None:
        from sglang.srt.placement.resolve import plan_engine

        placements = plan_engine(server_args, launcher="mp", **plan_kwargs)
    return run_ranks_mp(server_args, target=probe_target, placements=placements, timeout_s=timeout_s)


def run_ray(server_args: Any, *, placements: Optional[Sequence[ProcessPlacement]], timeout_s: float,
            plan_kwargs: Mapping[str, Any]) -> list:
    """Ray ranks, each node planning its own from its own host facts: only ``gpus`` and
    ``affinity_mode`` of ``plan_kwargs`` reach the nodes; the driver's topology does not."""
    from sglang.srt.scheduler_launch.ray_launcher import run_ranks_ray

    if placements is not None:
        raise ValueError("Ray ranks resolve their placement on the actor's node; verify cannot hand them a plan")
    return run_ranks_ray(server_args, target=probe_target, timeout_s=timeout_s, gpus=plan_kwargs.get("gpus"),
                         affinity_mode=plan_kwargs.get("affinity_mode"))


RUNNERS = {"mp": run_mp, "ray": run_ray}
