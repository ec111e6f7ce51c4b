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
"""Ray actor wrapper for SGLang Scheduler, started under the placement planned on its node.

Upstream's contract holds: ``SchedulerActor.options(...).remote(server_args,
port_args, gpu_id, tp_rank, pp_rank, dp_rank, dist_init_addr=None)`` builds
sglang's ``Scheduler``, and the engine calls ``get_info()`` then
``run_event_loop()``. What changed is where the rank runs. sglang's
``_create_scheduler_actor`` plans the rank's bundle on its node first and
hands the actor the result as ``start`` (one placement per GPU id Ray may give
it; it takes the one of the id it got). An ``exec`` placement started the
worker under numactl; anything else is applied in-process before the
scheduler allocates. An actor without a plan for its id places the GPU Ray
gave it, on its node, by Ray's own id, and binds in-process. Either way it
reads its binding back, every thread included: a rank that is not where its
placement says is a warning naming the rank, or, under
SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1, an initialisation error raised before the
``Scheduler`` is built. Those steps are ``SchedulerRank``'s
(``scheduler_placement.ray_rank``); this module adds upstream's bring-up.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

import ray

from sglang.srt.scheduler_placement.ray_rank import SchedulerRank

logger = logging.getLogger(__name__)


@ray.remote
class SchedulerActor(SchedulerRank):
    """Ray actor wrapper for SGLang Scheduler.

    Each actor manages one GPU and runs the Scheduler + TpModelWorker stack.
    Ray is used for process lifecycle; ZMQ handles request/response communication.
    """

    def _start_scheduler(
        self,
        server_args: Any,
        port_args: Any,
        *,
        gpu_id: int,
        dp_rank: Optional[int],
        dist_init_addr: Optional[str],
    ) -> None:
        from sglang.srt.arg_groups.overrides import declare_resolution
        from sglang.srt.managers.scheduler import (
            Scheduler,
            configure_scheduler_process,
            resolve_spawn_dp_rank,
        )
        from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank

        # Declared, not copied: Ray deserializes the argument per call, so this
        # record is the actor's own and nothing else in the process holds it.
        # The field stays the operator's input; `PortArgs.init_new` and the bags
        # this actor publishes read the decision.
        if dist_init_addr:
            declare_resolution(
                server_args, "ray.scheduler_actor", dist_init_addr=dist_init_addr
            )

        dp_rank = resolve_spawn_dp_rank(dp_rank)

        # This actor takes the place of run_scheduler_process, which is where
        # a forked scheduler publishes.
        publish(
            server_args,
            role="scheduler",
            ranks=SpawnRanks(
                world_rank=spawn_world_rank(
                    server_args, tp_rank=self._tp_rank, pp_rank=self._pp_rank
                ),
                dp_rank=dp_rank,
                gpu_id=gpu_id,
            ),
        )

        # Configure worker (logging, process title, etc.); the legacy V1 bind
        # (SGLANG_NUMA_BIND_V2=0) happens in there too.
        configure_scheduler_process(server_args, gpu_id)

        # Before the scheduler allocates anything: what numactl did not apply
        # (an in-process bind) is applied here, and the binding read back.
        self._place(server_args)

        # Create scheduler (loads model into GPU, initializes NCCL)
        self.scheduler = Scheduler(
            server_args=server_args,
            port_args=port_args,
        )

    def get_info(self) -> Dict[str, Any]:
        """Return scheduler initialization info for handshake."""
        return self.scheduler.get_init_info()

    def run_event_loop(self) -> None:
        """Run the scheduler's event loop. Blocks until shutdown."""
        try:
            import torch

            from sglang.srt.runtime_context import get_device

            # Need to set the GPU id for the event loop for nccl to work
            torch.cuda.set_device(get_device().gpu_id)
            self.scheduler.run_event_loop()
        except Exception as e:
            logger.error(f"Scheduler PP{self._pp_rank} TP{self._tp_rank} crashed: {e}")
            raise
