"""SGLANG_SET_CPU_AFFINITY=1 with NUMA binding: the rank ends where its placement says,
after sglang's own scheduler set-up (``run_scheduler_process``, which runs
``configure_scheduler_process``) has run in it.

The host: 2 NUMA nodes and 4 GPUs, GPUs 2-3 on node 1 (a fake sysfs tree whose nodes are
this machine's two CPUs; a numactl stand-in applies its CPU binding). The engine: dp2 x tp2,
so the rank on GPU 2 is DP1 TP0. sglang 0.5.23's own ``set_gpu_proc_affinity`` slices the
host's cores by GPU id without looking at NUMA: GPU 2 gets core 0, on node 0.

The test uses only upstream's entry points and sets both the harness's seams and the older
``SGLANG_SYSFS_ROOT``, so the same file runs against earlier trees of the project.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import fakesys
import pytest
from spawn_support import numactl_standin

HERE = Path(__file__).resolve().parent
TINY_MODEL = str(HERE / "data" / "tiny_llama")

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs this process may use"
)


class ReportingScheduler:
    """sglang's Scheduler, replaced: it reports the CPUs the rank runs on when built."""

    def __init__(self, server_args, port_args=None):
        self.async_d2h_worker, self.gracefully_exit = None, False
        self.metrics_reporter = type(
            "Reporter", (), {"_shutdown_fpm": lambda s: None}
        )()
        self.info = {"cpus": sorted(os.sched_getaffinity(0))}

    def get_init_info(self):
        return self.info

    def run_event_loop(self):
        return None


def launched_rank(*args):
    """The rank's target: sglang's own run_scheduler_process with ReportingScheduler."""
    import sglang.srt.managers.scheduler as scheduler

    scheduler.Scheduler = ReportingScheduler
    scheduler.run_scheduler_process(*args)


def two_node_host(root: Path) -> Path:
    low, high = sorted(os.sched_getaffinity(0))[:2]
    gpus = [fakesys.PciSpec(fakesys.gpu_address(i), i // 2) for i in range(4)]
    return fakesys.write_sysfs(
        root,
        fakesys.Host(
            nodes={0: fakesys.NodeSpec(cpus={low}), 1: fakesys.NodeSpec(cpus={high})},
            pci=[fakesys.host_bridge(0), *gpus],
        ),
    )


@pytest.fixture
def host(tmp_path, monkeypatch):
    from sglang.srt.placement import topology
    from sglang.srt.utils import numa_utils

    tree = two_node_host(tmp_path / "sys")
    bin_dir, _ = numactl_standin(tmp_path / "bin", "fake-host", tree=tree)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    # This process's seams, and the spawned rank's (the harness reads these).
    monkeypatch.setattr(topology, "SYSFS_ROOT", str(tree), raising=False)
    monkeypatch.setattr(numa_utils, "_is_cuda", True)
    monkeypatch.setenv("PLACEMENT_TESTS_SYSFS", str(tree))
    monkeypatch.setenv("PLACEMENT_TESTS_PLATFORM", "cuda")
    monkeypatch.setenv("SGLANG_SYSFS_ROOT", str(tree))  # the setting earlier trees read
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("SGLANG_SET_CPU_AFFINITY", "1")
    for name in ("SGLANG_NUMA_BIND_V2", "SGLANG_AUTO_NUMA_BIND"):
        monkeypatch.delenv(name, raising=False)
    return tree


def node_cpus(tree: Path, node: int) -> list[int]:
    text = (tree / f"devices/system/node/node{node}/cpulist").read_text().strip()
    return [int(cpu) for cpu in text.split(",")]


def test_gpu2_rank_of_dp2_tp2_ends_on_node_1_after_configure_scheduler_process(host):
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils import numa_utils

    server_args = ServerArgs(
        model_path=TINY_MODEL, device="cuda", tp_size=2, dp_size=2, log_level="error"
    )
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    # GPU 2 is DP1's first rank: the data-parallel controller's base_gpu_id 2, TP0.
    proc = ctx.Process(
        target=launched_rank, args=(server_args, None, 2, 0, 0, 1, writer)
    )
    with numa_utils.configure_subprocess(server_args, 2):
        proc.start()
    writer.close()
    try:
        assert reader.poll(120), "the rank did not report"
        cpus = reader.recv()["cpus"]
    finally:
        proc.join(30)
    assert cpus == node_cpus(host, 1), (
        f"GPU 2's rank runs on CPUs {cpus}; node 1 has {node_cpus(host, 1)}, "
        f"node 0 {node_cpus(host, 0)}"
    )
