# Copyright 2023-2024 SGLang Team
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# ==============================================================================
"""Ray actor wrapper for SGLang Scheduler."""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, Optional

import ray

from sglang.srt.arg_groups.overrides import declare_resolution
from sglang.srt.runtime_context import SpawnRanks, get_device, publish, spawn_world_rank
from sglang.srt.server_args import PortArgs, ServerArgs

logger = logging.getLogger(__name__)


def visible_index(ray_gpu_id: int) -> int:
    """The CUDA index of Ray's GPU ``ray_gpu_id`` in this process: its place in the
    ``CUDA_VISIBLE_DEVICES`` Ray set (0 where Ray narrowed it to the actor's GPU),
    or the id itself where nothing narrows it."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return ray_gpu_id
    entries = [entry.strip() for entry in visible.split(",")]
    if str(ray_gpu_id) not in entries:
        raise RuntimeError(
            f"Ray assigned GPU {ray_gpu_id}, but CUDA_VISIBLE_DEVICES={visible!r} in "
            "the actor does not list it: leave CUDA_VISIBLE_DEVICES to Ray, or with "
            "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 list every GPU of the node"
        )
    return entries.index(str(ray_gpu_id))


@ray.remote
class SchedulerActor:
    """Ray actor wrapper for SGLang Scheduler.

    Each actor manages one GPU and runs the Scheduler + TpModelWorker stack.
    Ray is used for process lifecycle; ZMQ handles request/response communication.
    """

    def __init__(
        self,
        server_args: ServerArgs,
        port_args: PortArgs,
        gpu_id: int,
        tp_rank: int,
        pp_rank: int,
        dp_rank: Optional[int],
        dist_init_addr: Optional[str] = None,
    ):
        from sglang.srt.managers.scheduler import (
            Scheduler,
            configure_scheduler_process,
            resolve_spawn_dp_rank,
        )

        # Declared, not copied: Ray deserializes the argument per call, so this
        # record is the actor's own and nothing else in the process holds it.
        # The field stays the operator's input; `PortArgs.init_new` and the bags
        # this actor publishes read the decision.
        if dist_init_addr:
            declare_resolution(
                server_args, "ray.scheduler_actor", dist_init_addr=dist_init_addr
            )

        # Get actual GPU IDs from Ray runtime context
        accelerator_ids = ray.get_runtime_context().get_accelerator_ids()
        assigned_gpus = accelerator_ids.get("GPU", [])

        if assigned_gpus:
            # Ray assigned specific GPU(s), use the first one
            actual_gpu_id = int(assigned_gpus[0])
            logger.info(f"[TP{tp_rank}] Ray assigned GPU: {actual_gpu_id}")
        else:
            # Fallback to passed gpu_id
            actual_gpu_id = gpu_id
            logger.info(f"[TP{tp_rank}] Using passed gpu_id: {gpu_id}")

        dp_rank = resolve_spawn_dp_rank(dp_rank)

        # This actor takes the place of run_scheduler_process, which is where
        # a forked scheduler publishes. The device its CUDA calls name is Ray's
        # GPU as this process sees it: Ray narrows CUDA_VISIBLE_DEVICES to it.
        device_index = actual_gpu_id
        if assigned_gpus and getattr(server_args, "device", None) in (None, "cuda"):
            device_index = visible_index(actual_gpu_id)
        publish(
            server_args,
            role="scheduler",
            ranks=SpawnRanks(
                world_rank=spawn_world_rank(
                    server_args, tp_rank=tp_rank, pp_rank=pp_rank
                ),
                dp_rank=dp_rank,
                gpu_id=device_index,
            ),
        )

        # Configure worker (logging, process title, etc.). Its placement step binds
        # this actor in-process, before the Scheduler exists (Ray cannot start it
        # under numactl): every thread, memory policy, pages; Ray's id names its GPU.
        configure_scheduler_process(server_args, actual_gpu_id)

        # Create scheduler (loads model into GPU, initializes NCCL)
        self.scheduler = Scheduler(
            server_args=server_args,
            port_args=port_args,
        )

        self._tp_rank = tp_rank
        self._pp_rank = pp_rank

    def get_info(self) -> Dict[str, Any]:
        """Return scheduler initialization info for handshake."""
        return self.scheduler.get_init_info()

    def run_event_loop(self) -> None:
        """Run the scheduler's event loop. Blocks until shutdown."""
        try:
            import torch

            # Need to set the GPU id for the event loop for nccl to work
            torch.cuda.set_device(get_device().gpu_id)
            self.scheduler.run_event_loop()
        except Exception as e:
            logger.error(f"Scheduler PP{self._pp_rank} TP{self._tp_rank} crashed: {e}")
            raise
