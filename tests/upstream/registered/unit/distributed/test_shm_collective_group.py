"""A CPU engine on an sgl-kernel whose initialize takes a group: through bootstrap, a
rank that dies stops its peers at once, in set-up and in an all-reduce, instead of at
--dist-timeout or never."""

import glob
import json
import multiprocessing
import os
import tempfile
import time
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

register_cpu_ci(est_time=90, suite="base-b-test-cpu")

FORK = multiprocessing.get_context("fork")
DIST_TIMEOUT = 40
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_hidden_layers": 2, "vocab_size": 256}  # fmt: skip


def run_rank(results, model, port, tp_size, rank, then):
    """One TP rank through bootstrap; ``then``: "pause" at sgl_kernel::initialize,
    "report" there, "exit" once set up, or "reduce" once its peer has exited."""
    bootstrap._is_cpu_amx_available = True  # the shm path runs on AMX or arm64
    common.cpu_has_amx_support = lambda: True
    initialize = torch.ops.sgl_kernel.initialize

    class Reporting:  # initialize, seen from this rank
        default = initialize.default

        def __call__(self, *args):
            results.put((rank, "at initialize", time.monotonic()))
            while then == "pause":
                time.sleep(1)
            return initialize(*args)

    torch.ops.sgl_kernel.initialize = Reporting()
    args = ServerArgs(model_path=model, device="cpu", tp_size=tp_size,
                      dist_timeout=DIST_TIMEOUT)  # fmt: skip
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=rank, gpu_id=rank))
    try:
        bootstrap.init_parallel_runtime(server_args=args, device="cpu", dist_port=port)
        torch.distributed.barrier()
        if then == "exit":
            os._exit(0)
        time.sleep(1)  # the peer is gone
        get_tp_group().all_reduce(torch.ones(4096, dtype=torch.bfloat16))
        results.put((rank, "returned", time.monotonic()))
    except RuntimeError as exc:
        results.put((rank, str(exc), time.monotonic()))


class TestShmGroupThroughBootstrap(CustomTestCase):
    def start(self, tp_size, plan):
        port, self.results = find_available_port(29000), FORK.Queue()
        self.addCleanup(lambda: [os.unlink(f) for f in glob.glob(
            f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*")])  # fmt: skip
        model = tempfile.TemporaryDirectory()
        self.addCleanup(model.cleanup)
        with open(os.path.join(model.name, "config.json"), "w") as config:
            json.dump(TINY_LLAMA, config)
        cpu = min(os.sched_getaffinity(0))
        environ = {"SGLANG_CPU_OMP_THREADS_BIND": "|".join([str(cpu)] * tp_size)}
        environ["SGLANG_NCCL_SO_PATH"] = os.devnull  # as on CPU-only torch: no NCCL
        ranks = {}
        with mock.patch.dict(os.environ, environ):
            for rank, then in enumerate(plan):
                args = (self.results, model.name, port, tp_size, rank, then)
                ranks[rank] = FORK.Process(target=run_rank, args=args)
                ranks[rank].start()
                self.addCleanup(ranks[rank].kill)
        return ranks

    def test_a_rank_killed_in_set_up_stops_its_peers_at_once(self):
        ranks = self.start(3, ["report", "report", "pause"])  # rank 2 never joins
        seen = {self.results.get(timeout=120)[0] for _ in range(3)}
        self.assertEqual(seen, {0, 1, 2})
        time.sleep(2)  # ranks 0 and 1 have made and mapped their segments
        ranks[1].kill()
        killed = time.monotonic()
        rank, error, at = self.results.get(timeout=2 * DIST_TIMEOUT)
        self.assertEqual(rank, 0)
        self.assertIn("rank 1 exited during set-up", error)
        self.assertLess(at - killed, 10)  # not --dist-timeout (40 s)

    def test_an_all_reduce_fails_once_a_peer_is_gone(self):
        self.start(2, ["reduce", "exit"])
        reports = [self.results.get(timeout=120) for _ in range(3)]
        rank, error, _ = reports[-1]
        self.assertEqual(rank, 0)
        self.assertIn("waits for rank 1, whose process is gone", error)
