"""The runners ``verify`` starts ranks with: each launcher core with the placement probe as its target.

The CLI hands these to :func:`sglang.srt.placement.verify.verify_ranks`, so the
placement package itself never imports a launcher.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Optional, Sequence

from sglang.srt.placement.types import ProcessPlacement
from sglang.srt.placement.verify import probe_target


# Host-independent planning inputs that a Ray rank's own resolution on its node must honour too;
# host facts (topology, affinity, capabilities, runtime) are the driver's and are read again there.
_NODE_INDEPENDENT_PLAN_KEYS = ("gpus", "affinity_mode")


def run_mp(server_args: Any, *, placements: Optional[Sequence[ProcessPlacement]], timeout_s: float,
            plan_kwargs: Mapping[str, Any]) -> list:
    from sglang.srt.scheduler_launch.mp import run_ranks_mp

    if placements is None:
        from sglang.srt.placement.resolve import plan_engine

        placements = plan_engine(server_args, launcher="mp", **plan_kwargs)
    return run_ranks_mp(server_args, target=probe_target, placements=placements, timeout_s=timeout_s)


def resolve_on_actor_node(server_args: Any, *, gpus: Any = None, affinity_mode: Optional[str] = None,
                          **kwargs: Any) -> ProcessPlacement:
    """Ray-side resolver (importable, top level): resolve_rank with the driver's --gpus and affinity mode."""
    from sglang.srt.placement.resolve import resolve_rank

    return resolve_rank(server_args, gpus=gpus, affinity_mode=affinity_mode, **kwargs)


def run_ray(server_args: Any, *, placements: Optional[Sequence[ProcessPlacement]], timeout_s: float,
             plan_kwargs: Mapping[str, Any]) -> list:
    from sglang.srt.scheduler_launch.ray_launcher import run_ranks_ray

    if placements is not None:
        raise ValueError("Ray ranks resolve their placement on the actor's node; verify cannot hand them a plan")
    forwarded = {k: plan_kwargs[k] for k in _NODE_INDEPENDENT_PLAN_KEYS if plan_kwargs.get(k) is not None}
    resolver = functools.partial(resolve_on_actor_node, **forwarded) if forwarded else None
    return run_ranks_ray(server_args, target=probe_target, timeout_s=timeout_s, resolver=resolver)


RUNNERS = {"mp": run_mp, "ray": run_ray}
