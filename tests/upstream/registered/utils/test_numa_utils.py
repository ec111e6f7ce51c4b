"""sglang 0.5.23's tests of numa_utils, ported to the placement core.

Where 0.5.23's tests patched a helper that no longer exists, these drive the
seams that replaced it: a small sysfs tree named by SGLANG_SYSFS_ROOT, a
stand-in numactl first on PATH, a pynvml stand-in in sys.modules, and a
MagicMock libnuma from get_libnuma. Comments mark what differs from 0.5.23 on
purpose.
"""

import multiprocessing
import multiprocessing.spawn
import os
import shutil
import stat
import tempfile
import threading
import unittest
from contextlib import ExitStack
from types import SimpleNamespace
from unittest.mock import MagicMock, patch

from sglang.srt.placement.numactl import cpu_option, default_prober, memory_options
from sglang.srt.scheduler_placement import spawn
from sglang.srt.utils.numa_utils import (
    _handle_numa_bind_failure,
    _is_numa_available,
    _node_cpus,
    _query_numa_node_for_gpu,
    configure_subprocess,
    get_numa_node_if_available,
    init_threads_binding,
    numa_bind_to_node,
)
from sglang.test.ci.ci_register import register_cpu_ci


def armed_prefix():
    """The numactl prefix configure_subprocess armed for this thread's spawns."""
    use = spawn._state.use
    return None if use is None else use.prefix


register_cpu_ci(est_time=30, suite="base-a-test-cpu")

NUMA_UTILS_LOGGER = "sglang.srt.utils.numa_utils"
# configure_subprocess reports a rank it cannot bind from the spawn glue, by rank.
SPAWN_LOGGER = "sglang.srt.scheduler_placement.spawn"

NVIDIA = "0x10de"
GPU_CLASS = "0x030200"
MEMBIND_REFUSED = "set_mempolicy: Invalid argument"
CPU_REFUSED = "sched_setaffinity: Operation not permitted"


def _cpulist(cpus):
    """A Linux cpulist ("0,21-71") of ``cpus``."""
    ordered = sorted(cpus)
    parts = []
    start = prev = None
    for cpu in ordered + [None]:
        if start is not None and cpu == prev + 1:
            prev = cpu
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = cpu
    return ",".join(parts)


def write_sysfs(root, nodes, pci=()):
    """A small sysfs tree under ``root``, as the kernel lays it out.

    ``nodes`` maps a node id to its CPUs (empty for a memory-only node); ``pci``
    lists ``(address, numa_node, vendor, pci_class)``, numa_node -1 when the
    kernel does not know the device's node.
    """
    files = {}
    cpus = sorted(cpu for node_cpus in nodes.values() for cpu in node_cpus)
    files["devices/system/cpu/online"] = _cpulist(cpus)
    for node, node_cpus in nodes.items():
        for cpu in node_cpus:
            base = f"devices/system/cpu/cpu{cpu}/topology"
            files[f"{base}/physical_package_id"] = str(node)
            files[f"{base}/core_id"] = str(cpu)
            files[f"{base}/thread_siblings_list"] = str(cpu)
    ids = sorted(nodes)
    for node in ids:
        base = f"devices/system/node/node{node}"
        files[f"{base}/cpulist"] = _cpulist(nodes[node])
        files[f"{base}/meminfo"] = f"Node {node} MemTotal:       16777216 kB\n"
        files[f"{base}/distance"] = " ".join("10" if n == node else "20" for n in ids)
    for address, numa_node, vendor, pci_class in pci:
        base = f"bus/pci/devices/{address}"
        files[f"{base}/numa_node"] = str(numa_node)
        files[f"{base}/vendor"] = vendor
        files[f"{base}/device"] = "0x2330"
        files[f"{base}/class"] = pci_class
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text + "\n")
    return root


def write_numactl(bindir, refuse=None):
    """A stand-in numactl: refuses the options named in ``refuse`` (prefix ->
    the message numactl prints), else runs the program as numactl does. Every
    run is logged, one line of arguments each, to ``bindir/numactl.log``."""
    cases = "".join(
        f"    {prefix}*) echo '{message}' >&2; exit 1 ;;\n"
        for prefix, message in (refuse or {}).items()
    )
    script = (
        "#!/bin/sh\n"
        f"printf '%s\\n' \"$*\" >> '{bindir}/numactl.log'\n"
        "for arg do\n"
        '  case "$arg" in\n'
        f"{cases}"
        "    --*) ;;\n"
        "    *) break ;;\n"
        "  esac\n"
        "done\n"
        'while [ $# -gt 0 ]; do case "$1" in --*) shift ;; *) exec "$@" ;; esac; done\n'
        "echo 'usage: numactl [--all | -a] [--interleave= | -i <nodes>]' >&2\n"
        "exit 1\n"
    )
    path = os.path.join(bindir, "numactl")
    with open(path, "w") as f:
        f.write(script)
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def numactl_calls(bindir):
    try:
        with open(os.path.join(bindir, "numactl.log")) as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


def probes(bindir):
    """The option sets numactl was probed with (``numactl <options> true``)."""
    true = shutil.which("true")
    return [
        line[: -len(true)].split()
        for line in numactl_calls(bindir)
        if line.endswith(true)
    ]


def start_spawned_child():
    """Start a trivial child with the spawn start method, as sglang does."""
    proc = multiprocessing.get_context("spawn").Process(target=os.getpid)
    proc.start()
    proc.join(60)
    return proc.exitcode


class _HostCase(unittest.TestCase):
    """A temp dir per test, for a sysfs tree and a bin dir with a stand-in numactl."""

    def setUp(self):
        # The environment is restored after everything else a test patched.
        environ = patch.dict(os.environ)
        environ.start()
        self.addCleanup(environ.stop)
        self.tmp = tempfile.mkdtemp(prefix="numa_utils_test_")
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)
        self.bindir = os.path.join(self.tmp, "bin")
        os.mkdir(self.bindir)
        self.allowed = set(os.sched_getaffinity(0))
        self.trees = 0

    def sysfs(self, nodes, pci=()):
        self.trees += 1
        root = write_sysfs(os.path.join(self.tmp, f"sys{self.trees}"), nodes, pci)
        os.environ["SGLANG_SYSFS_ROOT"] = root
        return root

    def numactl(self, refuse=None):
        path = write_numactl(self.bindir, refuse)
        os.environ["PATH"] = f"{self.bindir}{os.pathsep}{os.environ.get('PATH', '')}"
        return path

    def beyond(self, count):
        """``count`` CPU ids that this process may not use (the tree's own CPUs)."""
        top = max(self.allowed)
        return set(range(top + 1, top + 1 + count))


class TestIsNumaAvailable(unittest.TestCase):
    """Tests for _is_numa_available on both NUMA and non-NUMA systems."""

    @patch("sglang.srt.utils.numa_utils._is_cuda", False)
    def test_returns_false_when_not_cuda(self):
        self.assertFalse(_is_numa_available())

    @patch("sglang.srt.utils.numa_utils._is_cuda", True)
    @patch("os.path.isdir", return_value=False)
    def test_returns_false_when_no_numa_nodes(self, _mock_isdir):
        self.assertFalse(_is_numa_available())

    @patch("sglang.srt.utils.numa_utils._can_set_mempolicy", return_value=True)
    @patch("sglang.srt.placement.numactl.find_numactl", return_value="/usr/bin/numactl")
    @patch("sglang.srt.utils.numa_utils._is_cuda", True)
    @patch("os.path.isdir", return_value=True)
    def test_returns_true_on_numa_system(
        self, _mock_isdir, _mock_which, _mock_mempolicy
    ):
        self.assertTrue(_is_numa_available())

    @patch("sglang.srt.utils.numa_utils._can_set_mempolicy", return_value=False)
    @patch("sglang.srt.placement.numactl.find_numactl", return_value="/usr/bin/numactl")
    @patch("sglang.srt.utils.numa_utils._is_cuda", True)
    @patch("os.path.isdir", return_value=True)
    def test_returns_true_when_only_cpu_affinity_can_be_set(
        self, _mock_isdir, _mock_which, _mock_mempolicy
    ):
        # As in 0.5.23: a container without SYS_NICE still binds CPUs.
        self.assertTrue(_is_numa_available())

    @patch.dict(os.environ)
    @patch("sglang.srt.utils.numa_utils._can_set_mempolicy", return_value=True)
    @patch("sglang.srt.placement.numactl.find_numactl", return_value="/usr/bin/numactl")
    @patch("sglang.srt.utils.numa_utils._is_cuda", True)
    @patch("os.path.isdir", return_value=True)
    def test_isdir_called_with_node1_path(
        self, mock_isdir, _mock_which, _mock_mempolicy
    ):
        os.environ.pop("SGLANG_SYSFS_ROOT", None)
        _is_numa_available()
        mock_isdir.assert_called_with("/sys/devices/system/node/node1")


class TestIsNumaAvailableSysfsRoot(_HostCase):
    """New: the node check reads the tree SGLANG_SYSFS_ROOT names (default /sys)."""

    @patch("sglang.srt.utils.numa_utils._is_cuda", True)
    def test_follows_sglang_sysfs_root(self):
        self.numactl()
        self.sysfs({0: {0}, 1: {1}})
        self.assertTrue(_is_numa_available())
        self.sysfs({0: {0, 1}})
        self.assertFalse(_is_numa_available())


def _nvml_standin(bus_ids, *, affinity=(0b1010,), fail=False):
    """A pynvml stand-in: physical NVML index -> PCI bus id, and NVMLError."""
    nvml = MagicMock()
    nvml.NVMLError = type("NVMLError", (Exception,), {})
    nvml.NVML_AFFINITY_SCOPE_NODE = 0
    nvml.nvmlDeviceGetMemoryAffinity.return_value = list(affinity)

    def handle(index):
        if fail or not 0 <= index < len(bus_ids):
            raise nvml.NVMLError("Invalid Argument")
        return index

    nvml.nvmlDeviceGetHandleByIndex.side_effect = handle
    nvml.nvmlDeviceGetPciInfo.side_effect = lambda h: SimpleNamespace(busId=bus_ids[h])
    return nvml


def _live_pci_device():
    """A PCI device of this host (bus id as NVML writes it) and its sysfs node(s)."""
    try:
        devices = sorted(os.listdir("/sys/bus/pci/devices"))
    except FileNotFoundError:
        devices = []
    if not devices:
        return "00000000:FF:1F.7", []  # no PCI device here: one this host lacks
    address = devices[0]
    try:
        with open(f"/sys/bus/pci/devices/{address}/numa_node") as f:
            node = int(f.read())
    except FileNotFoundError:
        node = -1
    domain, rest = address.split(":", 1)
    return f"{int(domain, 16):08X}:{rest.upper()}", ([node] if node >= 0 else [])


@patch("sglang.srt.utils.numa_utils._is_xpu", False)
@patch("sglang.srt.utils.numa_utils._is_cuda", True)
class TestQueryNumaNodeForGpu(_HostCase):
    """Tests for _query_numa_node_for_gpu.

    Unlike 0.5.23, a GPU's node is the numa_node of its PCI address in sysfs,
    not NVML's memory-affinity bitmask: NVML only names the device's PCI address
    (and only when planning this host's own /sys), so a device has one node.
    """

    def gpus(self, *numa_nodes):
        pci = [
            (f"0000:{0x18 + 0x30 * i:02x}:00.0", node, NVIDIA, GPU_CLASS)
            for i, node in enumerate(numa_nodes)
        ]
        self.sysfs({0: {0}, 1: {1}, 2: {2}, 3: {3}}, pci)

    @patch.dict(os.environ, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    def test_single_node_affinity(self):
        self.gpus(0, 1)
        nvml = _nvml_standin(["00000000:18:00.0"])
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        with patch.dict("sys.modules", {"pynvml": nvml}):
            result = _query_numa_node_for_gpu(0)
        self.assertEqual(result, [0])
        # A tree other than /sys describes another host: this host's NVML is not asked.
        nvml.nvmlInit.assert_not_called()

    @patch.dict(os.environ, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    def test_second_node_affinity(self):
        self.gpus(0, 1)
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        self.assertEqual(_query_numa_node_for_gpu(1), [1])

    @patch.dict(
        os.environ, {"CUDA_VISIBLE_DEVICES": "3,1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    )
    def test_logical_index_follows_cuda_visible_devices(self):
        self.gpus(0, 2, 1, 3)
        self.assertEqual(_query_numa_node_for_gpu(0), [3])
        self.assertEqual(_query_numa_node_for_gpu(1), [2])

    @patch.dict(os.environ, {"CUDA_VISIBLE_DEVICES": "2,0"})
    def test_multiple_node_affinity(self):
        # 0.5.23 returned every node of NVML's memory affinity ([1, 3] here); the
        # node is now the one sysfs gives the device's PCI address.
        os.environ.pop("SGLANG_SYSFS_ROOT", None)
        bus_id, expected = _live_pci_device()
        nvml = _nvml_standin(["00000000:FF:1F.6", "00000000:FF:1F.5", bus_id])
        with patch.dict("sys.modules", {"pynvml": nvml}):
            result = _query_numa_node_for_gpu(0)
        self.assertEqual(result, expected)
        self.assertLessEqual(len(result), 1)
        nvml.nvmlDeviceGetMemoryAffinity.assert_not_called()

    @patch.dict(os.environ, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    def test_no_affinity(self):
        # A device whose numa_node is -1 (the kernel does not know) has no node.
        self.gpus(-1)
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        with self.assertLogs(NUMA_UTILS_LOGGER, level="WARNING") as cm:
            result = _query_numa_node_for_gpu(0)
        self.assertEqual(result, [])
        self.assertTrue(any("numa_node -1" in msg for msg in cm.output), cm.output)

    @patch.dict(os.environ, {"CUDA_VISIBLE_DEVICES": "2,0"})
    def test_nvml_shutdown_called_on_success(self):
        os.environ.pop("SGLANG_SYSFS_ROOT", None)
        bus_id, _ = _live_pci_device()
        nvml = _nvml_standin(["00000000:FF:1F.6", "00000000:FF:1F.5", bus_id])
        with patch.dict("sys.modules", {"pynvml": nvml}):
            _query_numa_node_for_gpu(0)
        nvml.nvmlInit.assert_called_once()
        # Logical device 0 is physical device 2 under CUDA_VISIBLE_DEVICES=2,0.
        nvml.nvmlDeviceGetHandleByIndex.assert_called_once_with(2)
        nvml.nvmlShutdown.assert_called_once()

    @patch.dict(os.environ, {"CUDA_VISIBLE_DEVICES": "1"})
    def test_nvml_shutdown_called_on_error(self):
        os.environ.pop("SGLANG_SYSFS_ROOT", None)
        nvml = _nvml_standin(["00000000:18:00.0", "00000000:81:00.0"], fail=True)
        with patch.dict("sys.modules", {"pynvml": nvml}):
            result = _query_numa_node_for_gpu(0)
        self.assertIsInstance(result, list)
        nvml.nvmlDeviceGetHandleByIndex.assert_called_once_with(1)
        nvml.nvmlShutdown.assert_called_once()


class TestGetNumaNodeIfAvailable(unittest.TestCase):
    """Tests for get_numa_node_if_available combining _is_numa_available +
    _query_numa_node_for_gpu."""

    def _make_server_args(self, numa_node=None):
        args = MagicMock()
        args.numa_node = numa_node
        return args

    def test_returns_explicit_numa_node_from_server_args(self):
        args = self._make_server_args(numa_node=[2, 3, 0, 1])
        self.assertEqual(get_numa_node_if_available(args, 0), 2)
        self.assertEqual(get_numa_node_if_available(args, 1), 3)
        self.assertEqual(get_numa_node_if_available(args, 2), 0)
        self.assertEqual(get_numa_node_if_available(args, 3), 1)

    @patch("sglang.srt.utils.numa_utils._is_numa_available", return_value=False)
    def test_returns_none_when_numa_not_available(self, _mock_avail):
        args = self._make_server_args(numa_node=None)
        self.assertIsNone(get_numa_node_if_available(args, 0))

    @patch("sglang.srt.utils.numa_utils._query_numa_node_for_gpu", return_value=[])
    @patch("sglang.srt.utils.numa_utils._is_numa_available", return_value=True)
    def test_returns_none_when_query_returns_empty(self, _mock_avail, _mock_gpu):
        args = self._make_server_args(numa_node=None)
        self.assertIsNone(get_numa_node_if_available(args, 0))

    @patch("sglang.srt.utils.numa_utils._query_numa_node_for_gpu", return_value=[1])
    @patch("sglang.srt.utils.numa_utils._is_numa_available", return_value=True)
    def test_returns_queried_single_node(self, _mock_avail, _mock_gpu):
        args = self._make_server_args(numa_node=None)
        self.assertEqual(get_numa_node_if_available(args, 0), 1)

    @patch("sglang.srt.utils.numa_utils._query_numa_node_for_gpu", return_value=[0, 2])
    @patch("sglang.srt.utils.numa_utils._is_numa_available", return_value=True)
    def test_returns_first_node_when_multiple_found(self, _mock_avail, _mock_gpu):
        args = self._make_server_args(numa_node=None)
        self.assertEqual(get_numa_node_if_available(args, 0), 0)

    @patch("sglang.srt.utils.numa_utils._query_numa_node_for_gpu", return_value=[0, 2])
    @patch("sglang.srt.utils.numa_utils._is_numa_available", return_value=True)
    def test_logs_warning_when_multiple_nodes(self, _mock_avail, _mock_gpu):
        args = self._make_server_args(numa_node=None)
        with self.assertLogs(NUMA_UTILS_LOGGER, level="WARNING") as cm:
            get_numa_node_if_available(args, 0)
        self.assertTrue(any("Multiple NUMA nodes" in msg for msg in cm.output))

    @patch("sglang.srt.utils.numa_utils._is_numa_available", return_value=True)
    @patch("sglang.srt.utils.numa_utils._query_numa_node_for_gpu", return_value=[1])
    def test_explicit_server_args_takes_precedence(self, _mock_gpu, _mock_avail):
        args = self._make_server_args(numa_node=[5, 6])
        result = get_numa_node_if_available(args, 0)
        self.assertEqual(result, 5)
        _mock_avail.assert_not_called()
        _mock_gpu.assert_not_called()


def _get_gpu_info():
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        if isinstance(name, bytes):
            name = name.decode()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
        return name, count
    except Exception:
        return "", 0


_gpu_name, _gpu_count = _get_gpu_info()


def _query_single_numa_node_for_gpu(gpu_id):
    nodes = _query_numa_node_for_gpu(gpu_id)
    if len(nodes) != 1:
        raise AssertionError(f"GPU {gpu_id}: expected one NUMA node, got {nodes}")
    return nodes[0]


@unittest.skipUnless(
    ("GB200" in _gpu_name or "GB300" in _gpu_name) and _gpu_count == 4,
    "Requires 4-GPU Grace Blackwell hardware",
)
@patch("sglang.srt.utils.numa_utils._is_xpu", False)
@patch("sglang.srt.utils.numa_utils._is_cuda", True)
class TestGraceBlackwellNumaTopology(unittest.TestCase):
    """Hardware test validating expected NUMA topology on 4-GPU GB200/GB300."""

    def test_gpu_numa_mapping(self):
        self.assertEqual(_gpu_count, 4)
        expected = {0: 0, 1: 0, 2: 1, 3: 1}
        for gpu_id, expected_node in expected.items():
            result = _query_single_numa_node_for_gpu(gpu_id)
            self.assertEqual(
                result,
                expected_node,
                f"GPU {gpu_id}: expected NUMA node {expected_node}, got {result}",
            )


@unittest.skipUnless(
    "B200" in _gpu_name and _gpu_count == 4,
    "Requires 4-GPU B200 hardware",
)
@patch("sglang.srt.utils.numa_utils._is_xpu", False)
@patch("sglang.srt.utils.numa_utils._is_cuda", True)
class TestB200NumaTopology(unittest.TestCase):
    """Hardware test validating expected NUMA topology on 4-GPU B200."""

    def test_gpu_numa_mapping(self):
        self.assertEqual(_gpu_count, 4)
        numa_nodes = {
            _query_single_numa_node_for_gpu(gpu_id) for gpu_id in range(_gpu_count)
        }
        self.assertEqual(
            len(numa_nodes),
            1,
            "Expected all visible 4-GPU B200 devices on one NUMA node, "
            f"got {numa_nodes}",
        )


def _server_args(numa_node):
    # The fields placement reads; a MagicMock would answer any other with a mock.
    return SimpleNamespace(numa_node=numa_node, device="cuda")


class TestNumaBindIntersection(_HostCase):
    """Tests for constraint-aware NUMA binding (node CPUs intersected with the
    process's allowed CPUs) of a spawned scheduler.

    0.5.23's _numactl_cpu_mem_args(node, gpu_id) is gone: configure_subprocess
    now places the GPU id and arms the spawn with the numactl options, and the
    allowed CPUs are this process's own (Cpus_allowed_list), so the tree's node
    CPUs are laid out around them.
    """

    def placed_options(self):
        """The numactl options configure_subprocess arms for GPU 0 on node 0."""
        with configure_subprocess(_server_args([0, 1]), 0):
            prefix = armed_prefix()
            self.assertEqual(start_spawned_child(), 0)
        self.assertIsNotNone(prefix, "configure_subprocess armed no numactl prefix")
        self.assertEqual(prefix[0], os.path.join(self.bindir, "numactl"))
        # The child really started under those options.
        started = [
            c for c in numactl_calls(self.bindir) if "--multiprocessing-fork" in c
        ]
        self.assertEqual(len(started), 1)
        self.assertTrue(started[0].startswith(" ".join(prefix[1:]) + " "), started)
        return " ".join(prefix[1:])

    @patch.dict(os.environ, {"SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "0"})
    def test_numactl_args_unconstrained_uses_cpunodebind(self):
        self.numactl()
        self.sysfs({0: self.allowed, 1: self.beyond(4)})
        self.assertEqual(self.placed_options(), "--cpunodebind=0 --membind=0")

    @patch.dict(os.environ, {"SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "0"})
    def test_numactl_args_constrained_uses_physcpubind(self):
        self.numactl()
        cpu = min(self.allowed)
        self.sysfs({0: {cpu} | self.beyond(3), 1: self.beyond(6) - self.beyond(3)})
        self.assertEqual(self.placed_options(), f"--physcpubind={cpu} --membind=0")

    @patch.dict(os.environ, {"SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "0"})
    def test_numactl_args_empty_intersection_returns_none(self):
        self.numactl()
        self.sysfs({0: self.beyond(4), 1: self.allowed})
        executable = multiprocessing.spawn.get_executable()
        with self.assertLogs(SPAWN_LOGGER, level="WARNING") as cm:
            with configure_subprocess(_server_args([0, 1]), 0):
                self.assertIsNone(armed_prefix())
                self.assertEqual(multiprocessing.spawn.get_executable(), executable)
        self.assertTrue(
            any(
                "has no CPU cores allowed by the current affinity" in m
                for m in cm.output
            ),
            cm.output,
        )
        self.assertEqual(numactl_calls(self.bindir), [])

    @patch.dict(os.environ, {"SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "1"})
    def test_numactl_args_empty_intersection_crashes_when_enabled(self):
        self.numactl()
        self.sysfs({0: self.beyond(4), 1: self.allowed})
        with self.assertRaises(RuntimeError):
            with configure_subprocess(_server_args([0, 1]), 0):
                self.fail("contextmanager must not yield when crash-on-failure is set")


class TestNumaBindIntersectionInProcess(_HostCase):
    """The same intersection for numa_bind_to_node, which binds the calling process
    (split from 0.5.23's TestNumaBindIntersection)."""

    def test_node_cpus_come_from_sysfs_without_libnuma(self):
        # 0.5.23 asked libnuma (no libnuma: no CPUs); node CPUs now come from sysfs.
        self.sysfs({0: set(range(72)), 1: set(range(72, 144)), 2: set()})
        with patch("sglang.srt.utils.numa_utils.get_libnuma", return_value=None):
            self.assertEqual(_node_cpus(0), set(range(72)))
            self.assertEqual(_node_cpus(2), set())
            self.assertEqual(_node_cpus(7), set())

    def bind(self, allowed, *, node=0, mempolicy=True):
        """numa_bind_to_node(node) on 2 x 72 CPUs, with a memory-only node 2."""
        self.sysfs({0: set(range(72)), 1: set(range(72, 144)), 2: set()})
        lib = MagicMock()
        lib.numa_available.return_value = 0
        # The bind itself goes through placement's libnuma (set_mempolicy, migrate).
        lib.configured_nodes.return_value = frozenset({0, 1, 2})
        lib.migrate_pages.return_value = 0
        started, stop = threading.Event(), threading.Event()
        worker = threading.Thread(target=lambda: (started.set(), stop.wait(30)))
        worker.start()
        self.addCleanup(worker.join)
        self.addCleanup(stop.set)
        started.wait(30)
        with ExitStack() as stack:
            for name, value in (
                ("get_libnuma", lib),
                ("_can_set_mempolicy", mempolicy),
            ):
                stack.enter_context(
                    patch(f"sglang.srt.utils.numa_utils.{name}", return_value=value)
                )
            stack.enter_context(
                patch("sglang.srt.placement.apply.load_libnuma", return_value=lib)
            )
            stack.enter_context(patch("os.sched_getaffinity", return_value=allowed))
            setaff = stack.enter_context(patch("os.sched_setaffinity"))
            numa_bind_to_node(node)
        return lib, setaff, worker.native_id

    def test_numa_bind_to_node_constrained_sets_intersection(self):
        lib, mock_setaff, worker = self.bind({0} | set(range(21, 144)))
        # Unlike 0.5.23 (the calling thread only), every thread of the process is
        # moved: a thread started by an import would otherwise stay unbound.
        target = {0} | set(range(21, 72))
        threads = {c.args[0] for c in mock_setaff.call_args_list}
        self.assertIn(threading.get_native_id(), threads)
        self.assertIn(worker, threads)
        self.assertEqual(len(threads), mock_setaff.call_count)
        for call in mock_setaff.call_args_list:
            self.assertEqual(set(call.args[1]), target)
        lib.set_preferred.assert_called_once_with(0)
        # Unlike 0.5.23, the pages touched so far move to the node.
        lib.migrate_pages.assert_called_once_with(0, {1, 2}, {0})

    def test_numa_bind_to_node_without_mempolicy_binds_cpus_only(self):
        with self.assertLogs(NUMA_UTILS_LOGGER, level="INFO") as cm:
            lib, mock_setaff, _ = self.bind(set(range(144)), node=1, mempolicy=False)
        self.assertTrue(mock_setaff.called)
        for call in mock_setaff.call_args_list:
            self.assertEqual(set(call.args[1]), set(range(72, 144)))
        lib.set_preferred.assert_not_called()
        self.assertTrue(any("binding CPUs only" in m for m in cm.output), cm.output)

    def test_numa_bind_to_node_memory_only_node_prefers_its_memory(self):
        # 0.5.23's numa_run_on_node fails on a node without CPUs: they stay as they are.
        lib, mock_setaff, _ = self.bind(set(range(144)), node=2)
        mock_setaff.assert_not_called()
        lib.set_preferred.assert_called_once_with(2)

    @patch.dict(os.environ, {"SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "0"})
    def test_numa_bind_to_node_empty_intersection_skips(self):
        with self.assertLogs(NUMA_UTILS_LOGGER, level="WARNING"):
            lib, mock_setaff, _ = self.bind(set(range(72, 144)))
        mock_setaff.assert_not_called()
        lib.set_preferred.assert_not_called()

    @patch.dict(os.environ, {"SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "1"})
    def test_handle_failure_raises_when_enabled(self):
        with self.assertRaises(RuntimeError):
            _handle_numa_bind_failure(0, {72, 73})

    @patch.dict(os.environ, {"SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "0"})
    def test_handle_failure_warns_when_disabled(self):
        with self.assertLogs(NUMA_UTILS_LOGGER, level="WARNING"):
            _handle_numa_bind_failure(0, {72, 73})


class TestInitThreadsBinding(_HostCase):
    """New: a CPU-device rank's OpenMP CPUs, read from SGLANG_CPU_OMP_THREADS_BIND
    as placement reads it; a setting that cannot work is an error naming it
    (0.5.23 asserted)."""

    def test_all_gives_each_rank_one_cpu_per_core_of_its_node(self):
        self.sysfs({0: self.allowed, 1: self.beyond(2)})
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "all"
        with self.assertLogs(NUMA_UTILS_LOGGER, level="INFO") as cm:
            cpus = init_threads_binding(numa_index=0, world_size=1)
        self.assertEqual(cpus, ",".join(map(str, sorted(self.allowed))))
        # As 0.5.23's get_cpu_ids_by_node, a node without allowed CPUs is not counted.
        self.assertNotIn("numa nodes are used", "\n".join(cm.output))
        with self.assertRaisesRegex(ValueError, "rank index 1 has none"):
            init_threads_binding(numa_index=1, world_size=2)

    def test_groups_are_taken_as_written_and_bound_by_their_count(self):
        cpu = min(self.allowed)
        self.sysfs({0: self.allowed, 1: self.beyond(2)})
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = f"{cpu}|{cpu}"
        with self.assertLogs(NUMA_UTILS_LOGGER, level="WARNING") as cm:
            # A router's worker is a one-rank engine whose index counts across groups.
            self.assertEqual(init_threads_binding(numa_index=1, world_size=1), str(cpu))
        self.assertTrue(any("shares CPU(s)" in m for m in cm.output), cm.output)
        with self.assertRaisesRegex(ValueError, "has 2 group"):
            init_threads_binding(numa_index=2, world_size=3)
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = f"{cpu}|x"
        with self.assertRaisesRegex(ValueError, "not a cpulist"):
            init_threads_binding(numa_index=1, world_size=2)


class TestProbeNumactlArgs(_HostCase):
    """Tests for the numactl probe ladder: dry-run numactl and relax the memory
    policy (--membind -> --preferred -> CPU-only) when the kernel rejects the
    binding.

    0.5.23's _probe_numactl_args is now NumactlProber.ladder, found for the
    numactl on PATH; a stand-in numactl refuses what the test says, with the
    message numactl prints, instead of a mocked subprocess.run.
    """

    def ladder(self, cpu_args, mem_policy="bind"):
        prober = default_prober()
        self.assertEqual(prober.numactl_path, os.path.join(self.bindir, "numactl"))
        mem_nodes = [0] if mem_policy == "bind" else []
        return prober.ladder(
            cpu_args=cpu_args,
            mem_policy=mem_policy,
            mem_nodes=mem_nodes,
            preferred_node=0 if mem_nodes else None,
        )

    def test_membind_probe_succeeds_returns_original(self):
        self.numactl()
        outcome = self.ladder(["--cpunodebind=0"])
        self.assertTrue(outcome.ok)
        self.assertEqual(outcome.args, ("--cpunodebind=0", "--membind=0"))
        self.assertEqual(outcome.reasons, ())
        self.assertEqual(probes(self.bindir), [["--cpunodebind=0", "--membind=0"]])

    def test_membind_fails_preferred_succeeds(self):
        self.numactl({"--membind=": MEMBIND_REFUSED})
        outcome = self.ladder(["--cpunodebind=0"])
        self.assertEqual(outcome.args, ("--cpunodebind=0", "--preferred=0"))
        self.assertEqual(outcome.mem_policy, "preferred")
        self.assertTrue(any("preferred" in reason for reason in outcome.reasons))
        # Second probe must have used the --preferred form.
        second = probes(self.bindir)[1]
        self.assertIn("--preferred=0", second)
        self.assertNotIn("--membind=0", second)

    def test_membind_and_preferred_fail_cpu_only_succeeds(self):
        self.numactl({"--membind=": MEMBIND_REFUSED, "--preferred=": MEMBIND_REFUSED})
        outcome = self.ladder(["--physcpubind=0,21,22"])
        self.assertEqual(outcome.args, ("--physcpubind=0,21,22",))
        self.assertEqual(outcome.mem_policy, "none")
        self.assertTrue(any("CPU-only" in reason for reason in outcome.reasons))
        third = probes(self.bindir)[2]
        self.assertNotIn("--membind=0", third)
        self.assertNotIn("--preferred=0", third)

    def test_all_probes_fail_returns_none_with_last_stderr(self):
        # Every binding, down to CPU-only, is rejected; the reason kept is the
        # CPU-only (last) rejection.
        self.numactl(
            {
                "--membind=": MEMBIND_REFUSED,
                "--preferred=": MEMBIND_REFUSED,
                "--cpunodebind=": CPU_REFUSED,
            }
        )
        outcome = self.ladder(["--cpunodebind=0"])
        self.assertFalse(outcome.ok)
        self.assertEqual(outcome.args, ())
        self.assertEqual(outcome.reasons, (CPU_REFUSED,))
        self.assertEqual(len(probes(self.bindir)), 3)

    def test_cpu_only_input_failure_returns_none(self):
        # The requested args are already CPU-only: one probe, nothing to relax.
        self.numactl({"--cpunodebind=": CPU_REFUSED})
        outcome = self.ladder(["--cpunodebind=0"], mem_policy="none")
        self.assertFalse(outcome.ok)
        self.assertIn("sched_setaffinity", outcome.reasons[0])
        self.assertEqual(probes(self.bindir), [["--cpunodebind=0"]])

    def test_numactl_missing_returns_none(self):
        # numactl not installed: nothing to probe with; configure_subprocess then
        # leaves the rank unbound and says why.
        with patch.dict(os.environ, {"PATH": self.bindir}):
            self.assertIsNone(default_prober())
            self.sysfs({0: self.allowed, 1: self.beyond(2)})
            with self.assertLogs(SPAWN_LOGGER, level="WARNING") as cm:
                with configure_subprocess(_server_args([0, 1]), 0):
                    self.assertIsNone(armed_prefix())
        self.assertTrue(any("numactl is not installed" in m for m in cm.output))

    @patch.dict(os.environ, {"SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "0"})
    def test_rejection_stderr_surfaces_in_fallback_warning(self):
        # numactl's precise reason ("Invalid argument") reaches the warning, so
        # operators can tell seccomp from cpuset.
        self.numactl({"--membind=": MEMBIND_REFUSED})
        self.sysfs({0: self.allowed, 1: self.beyond(2)})
        with self.assertLogs(SPAWN_LOGGER, level="WARNING") as cm:
            with configure_subprocess(_server_args([0, 1]), 0):
                prefix = armed_prefix()
                self.assertEqual(start_spawned_child(), 0)
        self.assertEqual(prefix[1:], ("--cpunodebind=0", "--preferred=0"))
        self.assertTrue(
            any("Invalid argument" in msg and "preferred" in msg for msg in cm.output),
            f"expected numactl stderr in warning, got {cm.output}",
        )


class TestStripMemoryArgs(unittest.TestCase):
    """0.5.23's _strip_memory_args: the CPU-only step keeps the CPU binding and
    drops the memory segment. The ladder now builds each step from its parts."""

    def test_strips_membind_keeps_cpu(self):
        self.assertEqual(cpu_option(cpus={0, 1}, whole_nodes=[0]), "--cpunodebind=0")
        self.assertEqual(
            cpu_option(cpus={0, 21, 22}, whole_nodes=None), "--physcpubind=0,21-22"
        )
        self.assertEqual(
            memory_options(mem_policy="bind", mem_nodes=[0], preferred_node=0),
            ("--membind=0",),
        )
        self.assertEqual(
            memory_options(mem_policy="none", mem_nodes=[0], preferred_node=0), ()
        )

    def test_no_membind_returns_unchanged(self):
        self.assertEqual(
            memory_options(mem_policy="preferred", mem_nodes=[0], preferred_node=0),
            ("--preferred=0",),
        )
        self.assertEqual(
            memory_options(mem_policy="none", mem_nodes=[], preferred_node=None), ()
        )


class TestConfigureSubprocessProbeFailure(_HostCase):
    """Tests the wiring in configure_subprocess when the probe ladder gives up:
    the worker must start unbound (warn-and-yield) by default, or raise before
    yielding when SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1.

    A stand-in numactl refuses every binding; the node comes from --numa-node.
    The failure path must never install a numactl executable: the spawn
    executable stays as it is, no prefix is armed and numactl only ever runs
    the probes.
    """

    def setUp(self):
        super().setUp()
        self.numactl(
            {
                "--membind=": MEMBIND_REFUSED,
                "--preferred=": MEMBIND_REFUSED,
                "--cpunodebind=": "sched_setaffinity: Invalid argument",
            }
        )
        self.sysfs({0: self.allowed, 1: self.beyond(2)})
        self.executable = multiprocessing.spawn.get_executable()

    def assert_nothing_installed(self):
        self.assertEqual(multiprocessing.spawn.get_executable(), self.executable)
        self.assertIsNone(armed_prefix())
        true = shutil.which("true")
        self.assertTrue(numactl_calls(self.bindir))
        self.assertTrue(all(c.endswith(true) for c in numactl_calls(self.bindir)))

    @patch.dict(
        os.environ,
        {"SGLANG_NUMA_BIND_V2": "1", "SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "0"},
    )
    def test_probe_none_warns_and_yields_unbound(self):
        with self.assertLogs(SPAWN_LOGGER, level="WARNING") as cm:
            with configure_subprocess(_server_args([0, 1]), 0):
                self.assert_nothing_installed()  # worker would start unbound here
        self.assertTrue(
            any("could not apply NUMA binding" in msg for msg in cm.output),
            f"expected probe-failure warning, got {cm.output}",
        )
        self.assertTrue(
            any("Invalid argument" in msg for msg in cm.output),
            f"expected numactl stderr in warning, got {cm.output}",
        )
        self.assert_nothing_installed()

    @patch.dict(
        os.environ,
        {"SGLANG_NUMA_BIND_V2": "1", "SGLANG_CRASH_ON_NUMA_BIND_FAILURE": "1"},
    )
    def test_probe_none_raises_before_yield_when_crash_enabled(self):
        with self.assertRaises(RuntimeError) as cm:
            with configure_subprocess(_server_args([0, 1]), 0):
                self.fail("contextmanager must not yield when crash-on-failure is set")
        # The RuntimeError carries numactl's stderr, not just the failure category.
        self.assertIn("could not apply NUMA binding", str(cm.exception))
        self.assertIn("Invalid argument", str(cm.exception))
        self.assert_nothing_installed()


class TestConfigureSubprocessReportsByRank(_HostCase):
    """New: what goes wrong after the probes. A numactl that refuses the child's own
    start (the cpuset shrank since the probe) is the child's exit, which its launcher
    reports, with numactl's reason on its stderr; a block that spawned nothing gets
    a WARNING naming the rank."""

    def setUp(self):
        super().setUp()
        path = self.numactl()
        self.refuse = os.path.join(self.bindir, "refuse")
        with open(path) as f:
            script = f.read()
        check = f"[ -e '{self.refuse}' ] && {{ echo '{CPU_REFUSED}' >&2; exit 1; }}\n"
        with open(path, "w") as f:
            f.write(script.replace("#!/bin/sh\n", "#!/bin/sh\n" + check, 1))
        self.sysfs({0: self.allowed, 1: self.beyond(2)})
        os.environ["SGLANG_CRASH_ON_NUMA_BIND_FAILURE"] = "0"

    def test_a_child_numactl_refuses_exits_with_numactls_reason(self):
        proc = multiprocessing.get_context("spawn").Process(target=os.getpid)
        saved = os.dup(2)
        with tempfile.TemporaryFile() as stderr:
            os.dup2(stderr.fileno(), 2)  # the child's stderr
            try:
                with configure_subprocess(_server_args([0, 1]), 0):
                    open(self.refuse, "w").close()  # after the probes, before start
                    proc.start()
                proc.join(30)
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            stderr.seek(0)
            self.assertIn(CPU_REFUSED, stderr.read().decode())
        self.assertEqual(proc.exitcode, 1)

    def test_a_block_that_spawns_nothing_is_reported(self):
        with self.assertLogs(SPAWN_LOGGER, level="WARNING") as cm:
            with configure_subprocess(_server_args([0, 1]), 0):
                self.assertIsNotNone(armed_prefix())
        self.assertTrue(
            any(
                "no process was started with the spawn start method" in m
                for m in cm.output
            ),
            cm.output,
        )


if __name__ == "__main__":
    unittest.main()
