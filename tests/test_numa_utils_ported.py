"""A port of sglang 0.5.23's tests of numa_utils, run against the overlay (upstream's own
file runs unchanged in the stack's checkout: tests/test_stack.py).

numa_utils keeps upstream's helpers as the steps of the placement decision, so these
patch what 0.5.23's tests patch. Comments mark what differs from 0.5.23 on purpose.
"""

import os
import threading
import unittest
from contextlib import ExitStack
from unittest.mock import MagicMock, patch

from sglang.srt.environ import envs
from sglang.srt.placement import topology
from sglang.srt.utils.numa_utils import (
    _handle_numa_bind_failure,
    _is_numa_available,
    _node_cpus,
    _numactl_cpu_mem_args,
    _probe_numactl_args,
    _query_numa_node_for_gpu,
    _strip_memory_args,
    configure_subprocess,
    get_numa_node_if_available,
    numa_bind_to_node,
)


NUMA_UTILS = "sglang.srt.utils.numa_utils"
NODES_GLOB = [f"/sys/devices/system/node/node{n}" for n in range(4)]


class TestIsNumaAvailable(unittest.TestCase):
    @patch(f"{NUMA_UTILS}._is_cuda", False)
    @patch(f"{NUMA_UTILS}._is_xpu", False)
    def test_returns_false_when_not_cuda(self):
        self.assertFalse(_is_numa_available())

    @patch(f"{NUMA_UTILS}._is_cuda", True)
    @patch("os.path.isdir", return_value=False)
    def test_returns_false_when_no_numa_nodes(self, _isdir):
        self.assertFalse(_is_numa_available())

    @patch(f"{NUMA_UTILS}._can_set_mempolicy", return_value=False)
    @patch(f"{NUMA_UTILS}.shutil.which", return_value="/usr/bin/numactl")
    @patch(f"{NUMA_UTILS}._is_cuda", True)
    @patch("os.path.isdir", return_value=True)
    def test_returns_true_when_only_cpu_affinity_can_be_set(self, *_mocks):
        # As 0.5.23 does: a container without SYS_NICE still binds its CPUs.
        self.assertTrue(_is_numa_available())

    @patch(f"{NUMA_UTILS}.shutil.which", return_value="/usr/bin/numactl")
    @patch(f"{NUMA_UTILS}._is_cuda", True)
    @patch("os.path.isdir", return_value=True)
    def test_isdir_called_with_node1_path(self, isdir, _which):
        self.assertTrue(_is_numa_available())
        isdir.assert_called_with("/sys/devices/system/node/node1")


def _nvml(affinity):
    nvml = MagicMock()
    nvml.nvmlDeviceGetMemoryAffinity.return_value = affinity
    nvml.NVML_AFFINITY_SCOPE_NODE = 0
    return nvml


@patch(f"{NUMA_UTILS}._is_xpu", False)
@patch(f"{NUMA_UTILS}.glob.glob", return_value=NODES_GLOB)
class TestQueryNumaNodeForGpu(unittest.TestCase):
    """NVML's memory affinity, as 0.5.23 asks it, in one NVML session per query."""

    def query(self, gpu_id, affinity, environ=None):
        nvml = _nvml(affinity)
        with patch.dict("sys.modules", {"pynvml": nvml}), patch.dict(
            os.environ, environ or {}
        ):
            return _query_numa_node_for_gpu(gpu_id), nvml

    def test_single_node_affinity(self, _glob):
        nodes, nvml = self.query(0, [0b0001])
        self.assertEqual(nodes, [0])
        nvml.nvmlInit.assert_called_once()
        nvml.nvmlShutdown.assert_called_once()

    def test_multiple_node_affinity(self, _glob):
        self.assertEqual(self.query(0, [0b1010])[0], [1, 3])

    def test_no_affinity(self, _glob):
        self.assertEqual(self.query(0, [0])[0], [])

    def test_logical_index_follows_cuda_visible_devices(self, _glob):
        # New: CUDA_VISIBLE_DEVICES=2,0 makes logical GPU 0 NVML's device 2.
        _, nvml = self.query(0, [1], {"CUDA_VISIBLE_DEVICES": "2,0"})
        nvml.nvmlDeviceGetHandleByIndex.assert_called_once_with(2)


class TestGetNumaNodeIfAvailable(unittest.TestCase):
    def _make_server_args(self, numa_node=None):
        args = MagicMock()
        args.numa_node = numa_node
        return args

    def test_auto_numa_bind_enabled_by_default(self):
        with patch.dict(os.environ, {}, clear=True):
            self.assertTrue(envs.SGLANG_AUTO_NUMA_BIND.get())

    @patch.dict(os.environ, {"SGLANG_AUTO_NUMA_BIND": "0"})
    def test_returns_explicit_numa_node_when_auto_bind_disabled(self):
        args = self._make_server_args(numa_node=[2, 3, 0, 1])
        found = [get_numa_node_if_available(args, gpu_id) for gpu_id in range(4)]
        self.assertEqual(found, [2, 3, 0, 1])

    def test_a_short_numa_node_list_is_named(self):
        # New: 0.5.23 raised IndexError.
        with self.assertRaisesRegex(ValueError, "--numa-node has 2 entries"):
            get_numa_node_if_available(self._make_server_args(numa_node=[0, 1]), 2)

    @patch(f"{NUMA_UTILS}._is_numa_available", return_value=False)
    def test_returns_none_when_numa_not_available(self, _avail):
        self.assertIsNone(get_numa_node_if_available(self._make_server_args(), 0))

    @patch(f"{NUMA_UTILS}._query_numa_node_for_gpu", return_value=[0, 2])
    @patch(f"{NUMA_UTILS}._is_numa_available", return_value=True)
    def test_logs_warning_and_takes_the_first_of_multiple_nodes(self, *_mocks):
        with self.assertLogs(NUMA_UTILS, level="WARNING") as cm:
            node = get_numa_node_if_available(self._make_server_args(), 0)
        self.assertEqual(node, 0)
        self.assertTrue(any("Multiple NUMA nodes" in msg for msg in cm.output))


class TestNumaBindIntersection(unittest.TestCase):
    @patch(f"{NUMA_UTILS}.get_libnuma", return_value=None)
    def test_node_cpus_no_libnuma_returns_empty(self, _lib):
        self.assertEqual(_node_cpus(0), set())

    @patch("os.sched_getaffinity", return_value=set(range(72)))
    @patch(f"{NUMA_UTILS}._node_cpus", return_value=set(range(72)))
    def test_numactl_args_unconstrained_uses_cpunodebind(self, *_mocks):
        self.assertEqual(_numactl_cpu_mem_args(0, 0), "--cpunodebind=0 --membind=0")

    @patch("os.sched_getaffinity", return_value={0} | set(range(21, 144)))
    @patch(f"{NUMA_UTILS}._node_cpus", return_value=set(range(72)))
    def test_numactl_args_constrained_uses_physcpubind(self, *_mocks):
        listed = ",".join(map(str, [0, *range(21, 72)]))
        self.assertEqual(
            _numactl_cpu_mem_args(0, 0), f"--physcpubind={listed} --membind=0"
        )

    @patch.dict(os.environ, {"SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "1"})
    @patch("os.sched_getaffinity", return_value=set(range(72, 144)))
    @patch(f"{NUMA_UTILS}._node_cpus", return_value=set(range(72)))
    def test_numactl_args_empty_intersection_crashes_when_enabled(self, *_mocks):
        with self.assertRaises(RuntimeError):
            _numactl_cpu_mem_args(0, 0)

    def bind(self, allowed):
        """numa_bind_to_node(0) on a node of 72 CPUs, with a thread started before."""
        lib = MagicMock()
        lib.numa_available.return_value = 0
        lib.move_private_pages.return_value = 0
        stop = threading.Event()
        worker = threading.Thread(target=stop.wait, args=(30,))
        worker.start()
        self.addCleanup(worker.join)
        self.addCleanup(stop.set)
        with ExitStack() as stack:
            stack.enter_context(patch(f"{NUMA_UTILS}.get_libnuma", return_value=lib))
            stack.enter_context(
                patch(f"{NUMA_UTILS}._can_set_mempolicy", return_value=True)
            )
            stack.enter_context(
                patch("sglang.srt.placement.apply.load_libnuma", return_value=lib)
            )
            stack.enter_context(
                patch(f"{NUMA_UTILS}._node_cpus", return_value=set(range(72)))
            )
            stack.enter_context(patch("os.sched_getaffinity", return_value=allowed))
            setaffinity = stack.enter_context(patch("os.sched_setaffinity"))
            numa_bind_to_node(0)
        return lib, setaffinity, worker.native_id

    def test_numa_bind_to_node_constrained_sets_intersection_on_every_thread(self):
        lib, setaffinity, worker = self.bind({0} | set(range(21, 144)))
        # New: every thread moves (0.5.23: the calling one), and the pages this
        # process alone maps follow the node.
        threads = {call.args[0] for call in setaffinity.call_args_list}
        self.assertLessEqual({threading.get_native_id(), worker}, threads)
        for call in setaffinity.call_args_list:
            self.assertEqual(set(call.args[1]), {0} | set(range(21, 72)))
        lib.set_preferred.assert_called_once_with(0)
        lib.move_private_pages.assert_called_once()

    @patch.dict(os.environ, {"SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "0"})
    def test_numa_bind_to_node_empty_intersection_skips(self):
        with self.assertLogs(NUMA_UTILS, level="WARNING"):
            lib, setaffinity, _ = self.bind(set(range(72, 144)))
        setaffinity.assert_not_called()
        lib.set_preferred.assert_not_called()

    @patch.dict(os.environ, {"SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "1"})
    def test_handle_failure_raises_when_enabled(self):
        with self.assertRaises(RuntimeError):
            _handle_numa_bind_failure(0, {72, 73})

    @patch.dict(os.environ, {"SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "0"})
    def test_handle_failure_warns_when_disabled(self):
        with self.assertLogs(NUMA_UTILS, level="WARNING"):
            _handle_numa_bind_failure(0, {72, 73})


def _ran(returncode, stderr=b""):
    return MagicMock(returncode=returncode, stderr=stderr)


class TestProbeNumactlArgs(unittest.TestCase):
    @patch(f"{NUMA_UTILS}.subprocess.run")
    def test_membind_probe_succeeds_returns_original(self, run):
        run.side_effect = [_ran(0)]
        args = "--cpunodebind=0 --membind=0"
        self.assertEqual(_probe_numactl_args(args), (args, ""))

    @patch(f"{NUMA_UTILS}.subprocess.run")
    def test_membind_refused_falls_back_to_preferred_naming_why(self, run):
        run.side_effect = [
            _ran(1, b"numactl: setting membind: Invalid argument"),
            _ran(0),
        ]
        with self.assertLogs(NUMA_UTILS, level="WARNING") as cm:
            found = _probe_numactl_args("--cpunodebind=0 --membind=0")
        self.assertEqual(found, ("--cpunodebind=0 --preferred=0", ""))
        self.assertTrue(any("Invalid argument" in msg for msg in cm.output))

    @patch(f"{NUMA_UTILS}.subprocess.run")
    def test_membind_and_preferred_refused_cpu_only_succeeds(self, run):
        run.side_effect = [_ran(1), _ran(1), _ran(0)]
        with self.assertLogs(NUMA_UTILS, level="WARNING") as cm:
            found = _probe_numactl_args("--physcpubind=0,21,22 --membind=0")
        self.assertEqual(found, ("--physcpubind=0,21,22", ""))
        self.assertTrue(any("CPU-only" in msg for msg in cm.output))

    @patch(f"{NUMA_UTILS}.subprocess.run")
    def test_all_refused_returns_none_with_the_last_reason(self, run):
        run.side_effect = [_ran(1), _ran(1), _ran(1, b"cpunodebind: not permitted")]
        args, err = _probe_numactl_args("--cpunodebind=0 --membind=0")
        self.assertIsNone(args)
        self.assertIn("cpunodebind", err)

    @patch(f"{NUMA_UTILS}.subprocess.run", side_effect=FileNotFoundError("numactl"))
    def test_numactl_missing_returns_none(self, _run):
        self.assertIsNone(_probe_numactl_args("--cpunodebind=0 --membind=0")[0])


class TestStripMemoryArgs(unittest.TestCase):
    def test_strips_membind_keeps_cpu(self):
        self.assertEqual(
            _strip_memory_args("--cpunodebind=0 --membind=0"), "--cpunodebind=0"
        )
        self.assertEqual(_strip_memory_args("--cpunodebind=0"), "--cpunodebind=0")


class TestConfigureSubprocessProbeFailure(unittest.TestCase):
    """numactl refusing even the CPU binding: the rank starts unbound with the
    reason, or the launch stops under SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1."""

    def run_block(self):
        with ExitStack() as stack:
            for name, value in (
                ("get_numa_node_if_available", 0),
                ("_probe_numactl_args", (None, "numactl: setting membind: Invalid")),
            ):
                stack.enter_context(patch(f"{NUMA_UTILS}.{name}", return_value=value))
            create = stack.enter_context(
                patch(f"{NUMA_UTILS}._create_numactl_executable")
            )
            stack.enter_context(patch.object(topology, "SYSFS_ROOT", "/sys"))
            with configure_subprocess(MagicMock(), 0):
                pass
        create.assert_not_called()

    @patch.dict(os.environ, {"SGLANG_NUMA_BIND_V2": "1"})
    def test_probe_none_warns_and_yields_unbound(self):
        with patch.dict(os.environ, {"SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "0"}):
            with self.assertLogs(NUMA_UTILS, level="WARNING") as cm:
                self.run_block()
        self.assertTrue(any("could not apply NUMA binding" in m for m in cm.output))
        self.assertTrue(any("Invalid" in m for m in cm.output))

    @patch.dict(os.environ, {"SGLANG_NUMA_BIND_V2": "1"})
    def test_probe_none_raises_before_yield_when_crash_enabled(self):
        with patch.dict(os.environ, {"SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "1"}):
            with self.assertRaisesRegex(RuntimeError, "Invalid"):
                self.run_block()


if __name__ == "__main__":
    unittest.main()
