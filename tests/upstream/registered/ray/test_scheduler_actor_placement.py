"""A Ray scheduler actor is placed by Ray's GPU id and publishes the CUDA index its own
process sees; it binds every thread, in configure_scheduler_process, before its
Scheduler exists.

Each case runs sglang's own ``SchedulerActor.__init__`` (its ``configure_scheduler_process``
included) in a fresh interpreter, with a fake ``ray`` module (CPU runners ship no Ray) and
only the ``Scheduler`` replaced, on a sysfs tree of two nodes whose GPUs 2 and 3 sit on
node 1 (placement's ``topology.SYSFS_ROOT`` seam)."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=40, suite="base-a-test-cpu")

GPUS = ("0000:17:00.0", "0000:18:00.0", "0000:b1:00.0", "0000:b2:00.0")
MODEL = {  # what publish() resolves the server args against
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}

ACTOR = textwrap.dedent(
    """
    import json, os, sys, threading, types

    root, model, ray_gpu = sys.argv[1:]
    ray = types.ModuleType("ray")
    ray.remote = lambda cls: cls
    ray.is_initialized = lambda: True
    context = types.SimpleNamespace(
        get_accelerator_ids=lambda: {"GPU": [ray_gpu]}, get_actor_id=lambda: "actor"
    )
    ray.get_runtime_context = lambda: context
    ray.util = types.ModuleType("ray.util")
    names = {"placement_group": "PlacementGroup"}
    names["scheduling_strategies"] = "PlacementGroupSchedulingStrategy"
    for module, name in names.items():  # what sglang.srt.ray's engine imports
        fake = types.ModuleType(f"ray.util.{module}")
        setattr(fake, name, type(name, (), {}))
        sys.modules[f"ray.util.{module}"] = fake
    sys.modules.update({"ray": ray, "ray.util": ray.util})
    sys.modules["pynvml"] = None  # no NVML: the GPUs' PCI order in sysfs names them

    from sglang.srt.placement import topology
    from sglang.srt.utils import numa_utils

    topology.SYSFS_ROOT, numa_utils._is_cuda = root, True
    early = threading.Thread(target=threading.Event().wait, args=(60,), daemon=True)
    early.start()  # started before the actor binds

    import sglang.srt.managers.scheduler as scheduler
    from sglang.srt.runtime_context import get_device

    class Scheduler:
        def __init__(self, server_args, port_args):
            tasks = os.listdir("/proc/self/task")
            self.seen = {
                "cpus": sorted({c for t in tasks for c in os.sched_getaffinity(int(t))}),
                "gpu_id": get_device().gpu_id,
            }

    scheduler.Scheduler = Scheduler
    from sglang.srt.ray.scheduler_actor import SchedulerActor
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=model, device="cuda", tp_size=4, log_level="error")
    try:
        actor = SchedulerActor(args, None, 0, 0, 0, None)
    except RuntimeError as exc:
        print(json.dumps({"error": str(exc)}))
    else:
        print(json.dumps(actor.scheduler.seen))
    """
)


def write_host(root, node_cpus):
    """Nodes 0 and 1 with the CPUs given; GPUs 0 and 1 on node 0, 2 and 3 on node 1."""
    cpus = sorted(c for group in node_cpus for c in group)
    files = {"devices/system/cpu/online": ",".join(map(str, cpus))}
    for cpu in cpus:
        base = f"devices/system/cpu/cpu{cpu}/topology"
        node = 0 if cpu in node_cpus[0] else 1
        files[f"{base}/physical_package_id"] = str(node)
        files[f"{base}/core_id"] = str(cpu)
        files[f"{base}/thread_siblings_list"] = str(cpu)
    for node, group in enumerate(node_cpus):
        base = f"devices/system/node/node{node}"
        files[f"{base}/cpulist"] = ",".join(map(str, sorted(group)))
        files[f"{base}/meminfo"] = f"Node {node} MemTotal:       1048576 kB"
    for index, address in enumerate(GPUS):
        base = f"bus/pci/devices/{address}"
        files[f"{base}/numa_node"] = str(index // 2)
        files[f"{base}/vendor"] = "0x10de"
        files[f"{base}/device"] = "0x2330"
        files[f"{base}/class"] = "0x030200"
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text + "\n")


@unittest.skipUnless(shutil.which("numactl"), "upstream's NUMA discovery needs numactl")
@unittest.skipIf(len(os.sched_getaffinity(0)) < 2, "needs two CPUs, one per node")
class TestSchedulerActorPlacement(CustomTestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="scheduler_actor_placement_")
        cls.addClassCleanup(shutil.rmtree, cls.dir, ignore_errors=True)
        allowed = sorted(os.sched_getaffinity(0))
        cls.node1 = [allowed[-1]]
        write_host(os.path.join(cls.dir, "sys"), (allowed[:-1], cls.node1))
        os.makedirs(os.path.join(cls.dir, "model"))
        with open(os.path.join(cls.dir, "model", "config.json"), "w") as f:
            json.dump(MODEL, f)

    def start(self, ray_gpu, visible):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
        env.update(
            CUDA_DEVICE_ORDER="PCI_BUS_ID", SGLANG_CRASH_ON_NUMA_BIND_FAILURE="0"
        )
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        root, model = (os.path.join(self.dir, name) for name in ("sys", "model"))
        done = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", ACTOR, root, model, ray_gpu],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        self.assertEqual(done.returncode, 0, done.stderr[-3000:])
        return json.loads(done.stdout.strip().splitlines()[-1])

    def test_rays_gpu_3_is_placed_by_its_id_and_is_the_actors_device_0(self):
        # Ray narrows CUDA_VISIBLE_DEVICES to the actor's GPU: torch sees it as 0.
        seen = self.start("3", "3")
        self.assertEqual(seen, {"cpus": self.node1, "gpu_id": 0})

    def test_with_rays_visibility_left_alone_the_device_is_rays_id(self):
        # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1: the node's GPUs all visible.
        seen = self.start("3", "0,1,2,3")
        self.assertEqual(seen, {"cpus": self.node1, "gpu_id": 3})

    def test_a_gpu_the_actor_cannot_see_is_refused_naming_the_setting(self):
        seen = self.start("3", "1")
        self.assertIn("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", seen["error"])


if __name__ == "__main__":
    unittest.main()
