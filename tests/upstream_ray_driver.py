"""Creates scheduler actors the way sglang 0.5.23's RayEngine does, on a local Ray cluster with 2 declared GPUs.

Run as a script (the test starts it in a fresh process: ``ray.init`` happens once
per driver). Upstream's auto placement group of one 2-GPU bundle, then the
overlaid ``sglang.srt.ray.engine._create_scheduler_actor`` per rank with a real
``ServerArgs``, then ``get_info`` on each actor. Workers run
``upstream_standins.install`` first, so the actors build a stand-in Scheduler.
Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import fakesys


def main() -> None:
    real = frozenset(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="sglang-upstream-ray-") as tmp:
        # Node 0 is this host's own (its CPUs, so numactl can bind it); node 1 exists only in the tree.
        spare = frozenset(range(max(real) + 1, max(real) + 3))
        tree = fakesys.write_sysfs(os.path.join(tmp, "sys"), fakesys.Host(
            nodes={0: fakesys.NodeSpec(cpus=real), 1: fakesys.NodeSpec(cpus=spare)},
            pci=[fakesys.host_bridge(0), fakesys.PciSpec(fakesys.gpu_address(0), 0),
                 fakesys.PciSpec(fakesys.gpu_address(1), 0)],
        ))
        os.environ["SGLANG_SYSFS_ROOT"] = str(tree)
        os.environ["RAY_memory_monitor_refresh_ms"] = "0"
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)

        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        from sglang.srt.ray.engine import _create_scheduler_actor
        from sglang.srt.server_args import ServerArgs

        ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False,
                 _temp_dir=os.path.join(tmp, "ray"),
                 runtime_env={"worker_process_setup_hook": "upstream_standins.install"})
        try:
            pg = placement_group([{"CPU": 1, "GPU": 2}], strategy="STRICT_PACK")
            ray.get(pg.ready(), timeout=120)
            server_args = ServerArgs(model_path="/nonexistent", tp_size=2, device="cuda")
            actors = [
                _create_scheduler_actor(pg=pg, bundle_idx=0, gpu_id=tp_rank, server_args=server_args, port_args=None,
                                        tp_rank=tp_rank, pp_rank=0, dp_rank=0, dist_init_addr="127.0.0.1:29999",
                                        rank0_node_ip="127.0.0.1")
                for tp_rank in range(2)
            ]
            infos = ray.get([a.get_info.remote() for a in actors], timeout=300)
            bindings = ray.get([a.binding_report.remote() for a in actors], timeout=60)
            ray.get([a.run_event_loop.remote() for a in actors], timeout=60)
            names = sorted(name for name in ray.util.list_named_actors() if name.startswith("sglang_scheduler"))
            for actor in actors:
                ray.kill(actor)
            remove_placement_group(pg)
        finally:
            ray.shutdown()
    print(json.dumps({"infos": infos, "mismatches": [b.get("mismatches") for b in bindings], "names": names}))


if __name__ == "__main__":
    sys.exit(main())
