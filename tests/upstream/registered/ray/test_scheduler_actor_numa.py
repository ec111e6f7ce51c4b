"""A Ray scheduler actor binds itself to its own GPU's NUMA node: every thread,
the memory policy, and the pages it touched before binding. Its GPU is Ray's id as
NVML numbers it; in a container whose GPUs nothing can name, it stays unbound."""

import ctypes
import errno
import multiprocessing
import os
import shutil
import tempfile
import threading
import types
import unittest
from concurrent.futures import ProcessPoolExecutor
from unittest import mock

from sglang.srt.placement import apply, devices, libnuma, resolve
from sglang.srt.placement.types import ProcessAffinity
from sglang.srt.ray import scheduler_actor
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils import numa_utils
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=30, suite="base-a-test-cpu")

# The body behind @ray.remote, run in this process as Ray would run it.
actor_init = scheduler_actor.SchedulerActor.__ray_metadata__.modified_class.__init__
# An 8-GPU host's GPUs in PCI bus order (as sysfs lists them): 0-3 on node 0, 4-7 on 1.
HOST_GPUS = [f"0000:{bus}:00.0" for bus in "17 18 19 1a b1 b2 b3 b4".split()]


def cpulist(cpus):
    return ",".join(map(str, sorted(cpus)))


def write_host(root, node_cpus):
    """The sysfs files placement reads: nodes 0 and 1 with these CPUs, HOST_GPUS."""
    files = {"devices/system/cpu/online": cpulist(set().union(*node_cpus))}
    for node, cpus in enumerate(node_cpus):
        base = f"devices/system/node/node{node}/"
        files[base + "cpulist"] = cpulist(cpus)
        files[base + "meminfo"] = f"Node {node} MemTotal:       1048576 kB"
        files[base + "distance"] = "10 20" if node == 0 else "20 10"
        for cpu in cpus:
            base = f"devices/system/cpu/cpu{cpu}/topology/"
            files[base + "physical_package_id"] = str(node)
            files[base + "core_id"] = files[base + "thread_siblings_list"] = str(cpu)
    for index, address in enumerate(HOST_GPUS):
        base = f"bus/pci/devices/{address}/"
        files.update({base + "vendor": "0x10de", base + "class": "0x030200"})
        files.update({base + "device": "0x2330", base + "numa_node": str(index // 4)})
    for rel, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "w") as f:
            f.write(text + "\n")


def fake_pynvml(addresses):
    """pynvml whose device i is the GPU at PCI addresses[i]."""
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = type("NVMLError", (Exception,), {})
    nvml.nvmlInit = nvml.nvmlShutdown = lambda: None

    def get_handle(index):
        if 0 <= index < len(addresses):
            return index
        raise nvml.NVMLError("Invalid Argument")

    nvml.nvmlDeviceGetHandleByIndex = get_handle
    nvml.nvmlDeviceGetPciInfo = lambda handle: types.SimpleNamespace(
        busId=f"0000{addresses[handle]}".upper().encode()  # NVML's 8-digit domain
    )
    return nvml


def recording_libnuma(refuse=()):
    """placement's LibNuma on a kernel of nodes 0 and 1, recording its calls; those
    in ``refuse`` fail with OSError, as the real one's do when the kernel refuses."""
    lib = mock.create_autospec(libnuma.LibNuma, instance=True)
    lib.configured_nodes.return_value = frozenset({0, 1})
    lib.migrate_pages.return_value = 0  # the pages that stayed
    for call in refuse:
        error = OSError(errno.EPERM, f"libnuma {call} failed: Operation not permitted")
        getattr(lib, call).side_effect = error
    return lib


@unittest.skipIf(len(os.sched_getaffinity(0)) < 2, "needs two CPUs to tell apart")
class TestSchedulerActorNumaBind(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        stop = threading.Event()
        cls.addClassCleanup(stop.set)
        for _ in range(3):  # threads started before the actor binds
            threading.Thread(target=stop.wait, daemon=True).start()

    def setUp(self):
        # Node 1 gets one of the CPUs we may use, node 0 the rest.
        allowed = os.sched_getaffinity(0)
        self.node_cpus = (allowed - {max(allowed)}, {max(allowed)})
        self.root = tempfile.mkdtemp(prefix="ray_actor_numa_")
        self.addCleanup(shutil.rmtree, self.root, ignore_errors=True)
        write_host(self.root, self.node_cpus)
        for tid in map(int, os.listdir("/proc/self/task")):
            self.addCleanup(os.sched_setaffinity, tid, os.sched_getaffinity(tid))
        # The process may use node 1's memory too.
        every = ProcessAffinity(frozenset(allowed), frozenset({0, 1}), "this process")
        ray = {"get_accelerator_ids": lambda: self.ray_gpus}
        for patch in (
            # Stand-ins for the model and the process set-up around the bind.
            mock.patch.object(scheduler_actor, "publish"),
            mock.patch("sglang.srt.managers.scheduler.Scheduler"),
            mock.patch("sglang.srt.managers.scheduler.configure_scheduler_process"),
            # The tree is this host's /sys, and libnuma acts on its two nodes.
            mock.patch.object(devices, "is_live", lambda t: t.root == self.root),
            mock.patch.object(resolve, "read_process_affinity", lambda: every),
            mock.patch.object(resolve, "load_libnuma", lambda: self.libnuma),
            mock.patch.object(apply, "load_libnuma", lambda: self.libnuma),
            # Ray's GPU ids; the host's /dev/nvidiaN.
            mock.patch("ray.get_runtime_context", lambda: mock.Mock(**ray)),
            mock.patch.object(devices, "usable_nvidia_gpus", lambda: self.usable),
        ):
            patch.start()
            self.addCleanup(patch.stop)

    def start_actor(self, ray_gpu, visible, nvml_gpus, *, usable=8, crash="1", **kw):
        for tid in map(int, os.listdir("/proc/self/task")):  # every thread on node 0
            os.sched_setaffinity(tid, self.node_cpus[0])
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        env.update(SGLANG_SYSFS_ROOT=self.root, SGLANG_CRASH_ON_NUMA_BIND_FAILURE=crash)
        env.update(SGLANG_NUMA_BIND_V2="1", SGLANG_AUTO_NUMA_BIND="1")
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible  # as Ray sets it for the actor
        self.ray_gpus, self.usable = {"GPU": [ray_gpu]}, usable
        self.libnuma = recording_libnuma(kw.pop("refuse", ()))
        server_args = ServerArgs(model_path="/nonexistent", device="cpu")
        server_args.device, server_args.numa_node = "cuda", kw.pop("numa_node", None)
        nvml = None if nvml_gpus is None else fake_pynvml(nvml_gpus)
        modules = mock.patch.dict("sys.modules", pynvml=nvml)  # None: no NVML
        environ = mock.patch.dict(os.environ, env, clear=True)
        with environ, modules, self.assertLogs(level="INFO") as logs:
            actor_init(mock.Mock(), server_args, None, 0, 0, 0, None)
        return "\n".join(logs.output)

    def assert_threads_on(self, cpus):
        for tid in os.listdir("/proc/self/task"):
            self.assertEqual(os.sched_getaffinity(int(tid)), cpus, tid)

    def assert_bound_to_node_1(self, logs, gpu_id):
        self.assertIn(f"[TP0] Bound to NUMA node 1 for GPU {gpu_id}", logs)
        self.assert_threads_on(self.node_cpus[1])
        # Strict bind on node 1, then every other node's pages moved there.
        self.libnuma.set_membind.assert_called_once_with({1})
        self.libnuma.set_preferred.assert_not_called()
        self.libnuma.migrate_pages.assert_called_once_with(0, {0}, {1})

    def test_container_with_part_of_the_hosts_gpus(self):
        # NVML and Ray number the container's GPUs (the host's 4-7) from 0; sysfs
        # still lists all 8. Ray's GPU 0 is the host's GPU 4, on node 1.
        logs = self.start_actor("0", "0", HOST_GPUS[4:], usable=4)
        self.assert_bound_to_node_1(logs, gpu_id=0)

    def test_container_without_nvml_stays_unbound(self):
        # Nothing tells Ray's GPU 0 from the host's GPU 0 (node 0): no node is guessed.
        why = "sysfs lists 8 NVIDIA GPUs but this process may use 4"
        logs = self.start_actor("0", "0", None, usable=4, crash="0")
        self.assertNotIn("Bound to NUMA node", logs)
        self.assert_threads_on(self.node_cpus[0])
        self.assertEqual(self.libnuma.method_calls, [])
        self.assertRegex(logs, f"WARNING:.*{why}")
        with self.assertRaisesRegex(RuntimeError, why):
            self.start_actor("0", "0", None, usable=4, crash="1")

    def test_ray_gpu_5_is_the_actors_device_0(self):
        self.assert_bound_to_node_1(self.start_actor("5", "5", HOST_GPUS), 5)

    def test_ray_leaving_cuda_visible_devices_as_it_was(self):
        for visible in (None, "0,1,2,3,4,5,6,7"):
            with self.subTest(visible=visible):
                logs = self.start_actor("5", visible, HOST_GPUS)
                self.assert_bound_to_node_1(logs, gpu_id=5)

    def test_numa_node_flag_is_indexed_by_ray_gpu_id(self):
        # sysfs puts GPU 3 on node 0; the flag's entry 3 says node 1, and wins.
        logs = self.start_actor("3", "3", HOST_GPUS, numa_node=[0, 0, 0, 1])
        self.assert_bound_to_node_1(logs, gpu_id=3)

    def test_failed_migration_follows_the_failure_policy(self):
        with self.assertRaisesRegex(RuntimeError, "pages touched before binding"):
            self.start_actor("5", "5", HOST_GPUS, refuse={"migrate_pages"})


def bind_and_read_back(node):
    threading.Thread(target=threading.Event().wait, daemon=True).start()
    numa_utils.numa_bind_to_node(node)
    mode, nodes = ctypes.c_int(), (ctypes.c_ulong * 16)()
    ctypes.CDLL("libnuma.so.1").get_mempolicy(
        ctypes.byref(mode), nodes, ctypes.c_ulong(1024), None, ctypes.c_ulong(0)
    )
    tasks = os.listdir("/proc/self/task")
    return mode.value, nodes[0], [os.sched_getaffinity(int(t)) for t in tasks]


@unittest.skipUnless(numa_utils._can_set_mempolicy(), "needs libnuma and mempolicy")
class TestWholeProcessBindWithRealLibnuma(unittest.TestCase):
    """numa_bind_to_node on this host's node 0, through the real libnuma, in a child."""

    def test_every_thread_and_the_memory_policy(self):
        cpus = numa_utils._node_cpus(0) & os.sched_getaffinity(0)
        fork = multiprocessing.get_context("fork")
        with mock.patch.dict(os.environ, SGLANG_CRASH_ON_NUMA_BIND_FAILURE="1"):
            with ProcessPoolExecutor(1, mp_context=fork) as child:
                result = child.submit(bind_and_read_back, 0).result(timeout=60)
        mode, nodes, masks = result
        self.assertEqual((mode, nodes), (1, 1))  # MPOL_PREFERRED, node 0
        self.assertEqual(masks, [cpus] * len(masks))
        self.assertGreater(len(masks), 1)


if __name__ == "__main__":
    unittest.main()
