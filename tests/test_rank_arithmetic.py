"""``placement_tools.engine.local_ranks`` against sglang 0.5.23's own launchers, over a grid of engines.

``Engine._launch_scheduler_processes`` runs as installed, with a published
``ServerArgs``; where it starts the data-parallel controller, the controller runs
as installed too, in this process: its ``__init__``, ``launch_dp_schedulers``
(one thread per dp rank, its ``base_gpu_id`` step) and
``launch_tensor_parallel_group``. Only the process class, the pipes and
``numa_utils.configure_subprocess`` are recorders, and each controller thread
stops where it would sleep for the life of its schedulers. So every
(dp_rank, pp_rank, tp_rank, gpu_id) compared here is what upstream's arithmetic
computes: a change to it fails this test.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
import threading
import time
import types
from pathlib import Path

import pytest

from sglang.srt.placement_tools import engine as ranks

TINY_MODEL = str(Path(__file__).resolve().parent / "data" / "tiny_llama")

# (tp, pp, nnodes): every node rank of each is launched.
TOPOLOGIES = [
    (1, 1, 1),
    (2, 1, 1),
    (4, 1, 1),
    (1, 2, 1),
    (2, 2, 1),
    (4, 2, 1),
    (2, 1, 2),
    (4, 1, 2),
    (1, 2, 2),
    (2, 2, 2),
    (4, 2, 2),
    (4, 1, 4),
    (2, 2, 4),
    (4, 2, 4),
]
# (dp, base GPU id, GPU id step)
OFFSETS = [(1, 0, 1), (1, 3, 2), (2, 0, 1), (2, 1, 2), (3, 2, 3)]
GRID = [
    (tp, pp, dp, nnodes, node_rank, base, step)
    for (tp, pp, nnodes), (dp, base, step) in itertools.product(TOPOLOGIES, OFFSETS)
    for node_rank in range(nnodes)
]


class LaunchStopped(BaseException):
    """Raised where a controller thread would sleep for the life of its schedulers."""


@pytest.fixture(scope="module")
def upstream():
    """sglang's engine and data-parallel controller modules, imported once (torch: seconds).

    PortArgs names its IPC sockets after files it creates with ``tempfile``; they go
    to a directory removed when the module's tests end.
    """
    from sglang.srt.entrypoints import engine
    from sglang.srt.managers import data_parallel_controller
    from sglang.srt.utils import common

    with tempfile.TemporaryDirectory(prefix="ranks-") as ipc_dir:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(tempfile, "tempdir", ipc_dir)
            yield types.SimpleNamespace(
                engine=engine, dpc=data_parallel_controller, common=common
            )


class Launch:
    """Records what one launch spawns, in place of the process class and the pipes.

    Each spawn keeps its target, its arguments, the GPU id ``configure_subprocess``
    placed it on and the ``CUDA_VISIBLE_DEVICES`` it started under.
    """

    def __init__(self) -> None:
        self.spawns: list[types.SimpleNamespace] = []
        self.threads: list[threading.Thread] = []
        self._placing = threading.local()
        launch = self

        class Process:
            def __init__(self, target, args=(), kwargs=None):
                self.target, self.args, self.kwargs = target, args, kwargs or {}
                self.pid = None

            def start(self):
                self.pid = 100000 + len(launch.spawns)
                launch.spawns.append(
                    types.SimpleNamespace(
                        target=self.target,
                        args=self.args,
                        kwargs=self.kwargs,
                        placed_gpu_id=getattr(launch._placing, "gpu_id", None),
                        visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
                    )
                )

        class Thread(threading.Thread):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                launch.threads.append(self)

            def run(self):
                with contextlib.suppress(LaunchStopped):
                    super().run()

        self.mp = types.SimpleNamespace(Process=Process, Pipe=self._pipe)
        self.threading = types.SimpleNamespace(**vars(threading))
        self.threading.Thread = Thread
        self.time = types.SimpleNamespace(**vars(time))
        self.time.sleep = self._stop

    @staticmethod
    def _pipe(duplex=True):
        """A scheduler's pipe: what it sends when ready, and an end to close."""
        end = types.SimpleNamespace(
            recv=lambda: {"max_total_num_tokens": 1, "max_req_input_len": 1},
            send=lambda obj: None,
            close=lambda: None,
        )
        return end, end

    @staticmethod
    def _stop(seconds):
        raise LaunchStopped

    @contextlib.contextmanager
    def configure_subprocess(self, server_args, gpu_id):
        self._placing.gpu_id = gpu_id
        try:
            yield
        finally:
            self._placing.gpu_id = None


def scheduler(*args):
    raise AssertionError("a recorded launch never runs a scheduler")


def launched(upstream, monkeypatch, server_args) -> list[tuple]:
    """What sglang's own launch of ``server_args`` spawns on its node, in launch order.

    Each entry: (dp_rank, pp_rank, tp_rank, gpu_id, CUDA_VISIBLE_DEVICES).
    """
    from sglang.srt.runtime_context import publish, restore_context, snapshot_context
    from sglang.srt.server_args import PortArgs
    from sglang.srt.utils import numa_utils

    launch = Launch()
    for module in (upstream.engine, upstream.dpc):
        monkeypatch.setattr(module, "mp", launch.mp)
    monkeypatch.setattr(upstream.dpc, "threading", launch.threading)
    monkeypatch.setattr(upstream.dpc, "time", launch.time)
    monkeypatch.setattr(numa_utils, "configure_subprocess", launch.configure_subprocess)
    before = snapshot_context()
    try:
        # As Engine._launch_subprocesses does.
        publish(server_args, role="tokenizer")
        port_args = PortArgs.init_new(server_args)
        upstream.engine.Engine._launch_scheduler_processes(
            server_args, port_args, scheduler
        )
        dp_controllers = [
            s
            for s in launch.spawns
            if s.target is upstream.dpc.run_data_parallel_controller_process
        ]
        if dp_controllers:
            assert len(launch.spawns) == 1
            launch.spawns.clear()
            kwargs = dict(dp_controllers[0].kwargs)
            assert kwargs.pop("server_args") is server_args
            del kwargs["pipe_writer"]
            # As run_data_parallel_controller_process does in its own process.
            publish(server_args, role="dp_controller")
            controller = upstream.dpc.DataParallelController(server_args, **kwargs)
            try:
                for thread in launch.threads:
                    thread.join(timeout=30)
                    assert not thread.is_alive()
            finally:
                controller.context.destroy(linger=0)
            assert len(launch.threads) == server_args.dp_size
    finally:
        restore_context(before)
    spawned = []
    for spawn in launch.spawns:
        assert spawn.target is scheduler
        _, _, gpu_id, tp_rank, pp_rank, dp_rank = spawn.args[:6]
        assert spawn.placed_gpu_id == gpu_id  # configure_subprocess places the child's
        spawned.append((dp_rank or 0, pp_rank, tp_rank, gpu_id, spawn.visible))
    # The controller's dp ranks launch from concurrent threads: order by dp rank only.
    return sorted(spawned, key=lambda rank: rank[0])


def engine_args(tp, pp, dp, nnodes, node_rank, base, step):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(
        model_path=TINY_MODEL,
        device="cpu",
        tp_size=tp,
        pp_size=pp,
        dp_size=dp,
        nnodes=nnodes,
        node_rank=node_rank,
        base_gpu_id=base,
        gpu_id_step=step,
        dist_init_addr="127.0.0.1:29990" if nnodes > 1 else None,
    )


@pytest.mark.parametrize(
    "tp, pp, dp, nnodes, node_rank, base, step",
    GRID,
    ids=["tp{}-pp{}-dp{}-nodes{}-node{}-base{}-step{}".format(*p) for p in GRID],
)
def test_local_ranks_are_the_ranks_sglang_launches(
    upstream, monkeypatch, tp, pp, dp, nnodes, node_rank, base, step
):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    args = engine_args(tp, pp, dp, nnodes, node_rank, base, step)
    expected = [
        (r.dp_rank, r.pp_rank, r.tp_rank, r.device.index, None)
        for r in ranks.local_ranks(args)
    ]
    assert len(expected) == dp * tp * pp // nnodes
    assert launched(upstream, monkeypatch, args) == expected


@pytest.mark.parametrize("visible", [None, "7,6,5,4,3,2,1,0"])
@pytest.mark.parametrize("dp", [1, 2])
def test_one_visible_device_per_process_is_reindexed(
    upstream, monkeypatch, dp, visible
):
    """SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS=1 on a CUDA host: each child gets id 0
    and, as its one visible GPU, the one ``ranks.reindexed`` names."""
    from sglang.srt.platforms.cuda import CudaSRTPlatform

    monkeypatch.setattr(upstream.common, "current_platform", CudaSRTPlatform())
    monkeypatch.setenv("SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS", "1")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    env = {}
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        env["CUDA_VISIBLE_DEVICES"] = visible
    args = engine_args(2, 1, dp, 1, 0, 1, 2)
    expected = []
    for r in ranks.local_ranks(args):
        gpu_id, spawned_env = ranks.reindexed(r.device.index, env)
        visible_to_child = spawned_env["CUDA_VISIBLE_DEVICES"]
        expected.append((r.dp_rank, r.pp_rank, r.tp_rank, gpu_id, visible_to_child))
    assert {rank[3] for rank in expected} == {0}
    assert launched(upstream, monkeypatch, args) == expected
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == visible
