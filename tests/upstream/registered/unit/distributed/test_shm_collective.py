"""Co-located CPU engines that inherit MASTER_ADDR/MASTER_PORT: through bootstrap and
the CPU kernel, each engine stage sums over /dev/shm segments of its own, and no name
is left once its groups are built."""

import glob
import json
import multiprocessing
import os
import tempfile
import unittest
from unittest import mock

import torch

try:
    import sgl_kernel  # noqa: F401
except ImportError as exc:
    raise unittest.SkipTest(f"no CPU build of sgl_kernel: {exc}")

from sglang.srt.distributed import bootstrap
from sglang.srt.distributed.parallel_state import get_tp_group
from sglang.srt.runtime_context import SpawnRanks, publish
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils import common
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase, find_available_port

register_cpu_ci(est_time=60, suite="base-b-test-cpu")

FORK = multiprocessing.get_context("fork")
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_hidden_layers": 2, "vocab_size": 256}  # fmt: skip


def segments():
    """inode -> path of the /dev/shm files mapped here, semaphores and queues aside."""
    with open("/proc/self/maps") as maps:
        rows = [line.split() for line in maps if " /dev/shm/" in line]
    others = ("/dev/shm/sem.", "/dev/shm/sgl_shm_mq_")
    return {row[4]: row[5] for row in rows if not row[5].startswith(others)}


def run_rank(results, go, model, port, tp_size, pp_size, rank):
    bootstrap._is_cpu_amx_available = True  # the shm path runs on AMX or arm64
    common.cpu_has_amx_support = lambda: True
    args = ServerArgs(model_path=model, device="cpu", tp_size=tp_size, pp_size=pp_size)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=rank, gpu_id=rank))
    bootstrap.init_parallel_runtime(server_args=args, device="cpu", dist_port=port)
    torch.distributed.barrier()  # every stage of the engine is set up
    left = [path for path in segments().values() if os.path.exists(path)]
    master = [os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")]
    results.put((port, rank, sorted(segments()), master, left))
    go.wait(timeout=60)  # once the test has seen that no two engines share one
    data = [torch.full((4096,), rank % tp_size + 1.0, dtype=torch.bfloat16)] * 50
    sums = {get_tp_group().all_reduce(x.clone()).unique().item() for x in data}
    results.put((port, rank, sums))
    torch.distributed.barrier()


class TestColocatedEngines(CustomTestCase):
    def test_each_engine_stage_has_segments_of_its_own_and_leaves_none(self):
        a, b, inherited = (find_available_port(p) for p in (23000, 25000, 27000))
        for port in (a, b, inherited):  # 0.5.23's names, which it never unlinks
            self.addCleanup(lambda p=port: [os.unlink(f) for f in glob.glob(
                f"/dev/shm/deepspeed_allreduce_buffer_*_{p}_*")])  # fmt: skip
        go, results, model = FORK.Event(), FORK.Queue(), tempfile.TemporaryDirectory()
        self.addCleanup(model.cleanup)
        with open(os.path.join(model.name, "config.json"), "w") as config:
            json.dump(TINY_LLAMA, config)
        cpu = min(os.sched_getaffinity(0))
        environ = {"MASTER_ADDR": "localhost", "MASTER_PORT": str(inherited),
                   "SGLANG_CPU_OMP_THREADS_BIND": f"{cpu}|{cpu}",  # any host's CPUs
                   "SGLANG_NCCL_SO_PATH": os.devnull}  # as on CPU-only torch  # fmt: skip
        # a: TP 2; b: TP 1 in two pipeline stages. All four inherit MASTER_*.
        with mock.patch.dict(os.environ, environ):
            for rank in [(a, 2, 1, 0), (a, 2, 1, 1), (b, 1, 2, 0), (b, 1, 2, 1)]:
                process = FORK.Process(
                    target=run_rank, args=(results, go, model.name, *rank)
                )
                process.start()
                self.addCleanup(process.kill)
        reports = sorted(results.get(timeout=120) for _ in range(4))
        maps = [report[2] for report in reports]
        self.assertEqual(maps[0], maps[1])  # engine a's two ranks
        self.assertEqual(len({*maps[0], *maps[2], *maps[3]}), 4)
        self.assertEqual([r[3] for r in reports], [["localhost", str(inherited)]] * 4)
        self.assertEqual([r[4] for r in reports], [[]] * 4)
        go.set()
        sums = sorted(results.get(timeout=120) for _ in range(4))
        self.assertEqual([s[2] for s in sums], [{3.0}, {3.0}, {1.0}, {1.0}])
