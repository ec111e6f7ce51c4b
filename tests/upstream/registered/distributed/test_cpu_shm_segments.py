"""Co-located CPU engines keep their /dev/shm segments apart and leave none behind.

Each rank runs bootstrap's real `init_parallel_runtime` (gloo, the AMX gate forced
on) against stand-ins for sgl_kernel's CPU ops, under their real schemas. Like
shm.cpp, `initialize` reads LOCAL_SIZE, MASTER_ADDR and MASTER_PORT at the call,
creates its segment without O_EXCL, maps it and each peer's (retrying while a
peer's does not exist yet), and never unlinks.
"""

import contextlib
import mmap
import multiprocessing
import os
import socket
import struct
import time
import traceback
import unittest
from unittest import mock

import torch

from sglang.srt.distributed import bootstrap
from sglang.srt.runtime_context import SpawnRanks, publish
from sglang.srt.server_args import ServerArgs
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=60, suite="base-a-test-cpu")

SHM_DIR = "/dev/shm"
PREFIX = f"deepspeed_allreduce_buffer_{os.getuid()}_"
SEGMENT_BYTES = 4096
DEADLINE_S = 60.0
WATCHED = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE")
CALLS = []  # one per initialize in this process
_KEEP = []  # the stand-in's library and mappings, for the life of the process


def _map(name):
    deadline = time.monotonic() + DEADLINE_S
    while True:
        with contextlib.suppress(FileNotFoundError):
            with open(os.path.join(SHM_DIR, name), "r+b") as segment:
                if os.fstat(segment.fileno()).st_size >= SEGMENT_BYTES:  # written
                    _KEEP.append(mmap.mmap(segment.fileno(), SEGMENT_BYTES))
                    return _KEEP[-1]
        if time.monotonic() > deadline:
            raise TimeoutError(f"stand-in initialize: no segment {name}")
        time.sleep(0.01)


def _initialize(size, rank):
    if os.environ.get("LOCAL_SIZE") != str(size):
        return  # shm.cpp shares memory only when all ranks are local
    addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    names = [f"{PREFIX}{addr}_{port}_{r}" for r in range(size)]
    fd = os.open(os.path.join(SHM_DIR, names[rank]), os.O_RDWR | os.O_CREAT, 0o600)
    os.write(fd, struct.pack("q", os.getpid()).ljust(SEGMENT_BYTES, b"\0"))
    os.close(fd)
    pids = [struct.unpack_from("q", _map(name))[0] for name in names]
    CALLS.append({"segment": names[rank], "pids": pids})


def _register_kernel_standin():
    library = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name, schema, impl in (
        ("initialize", "(int size, int rank) -> ()", _initialize),
        ("init_cpu_threads_env", "(str cpu_ids) -> str", lambda cpu_ids: cpu_ids),
    ):
        if not hasattr(torch.ops.sgl_kernel, name):
            library.define(name + schema)
        library.impl(name, impl, "CompositeExplicitAutograd")  # ahead of the CPU build
    _KEEP.append(library)


def _run_rank(queue, index, port, tp_size, pp_size, tp_rank, pp_rank):
    report = {"index": index, "tp_size": tp_size, "pid": os.getpid()}
    try:
        _register_kernel_standin()
        bootstrap._is_cpu_amx_available = True  # the shm path runs on AMX or arm64
        args = ServerArgs(
            model_path="dummy", device="cpu", tp_size=tp_size, pp_size=pp_size
        )
        rank = pp_rank * tp_size + tp_rank
        publish(args, role="scheduler", ranks=SpawnRanks(world_rank=rank, gpu_id=rank))
        bootstrap.init_parallel_runtime(server_args=args, device="cpu", dist_port=port)
        report.update(calls=CALLS, environ={k: os.environ.get(k) for k in WATCHED})
        torch.distributed.barrier()  # the store lives in rank 0: leave together
    except BaseException:
        report["error"] = traceback.format_exc()
    queue.put(report)


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TestCoLocatedCpuEngines(unittest.TestCase):
    def test_engines_get_own_segments_and_unlink_them(self):
        inherited_port, port_a, port_b = _free_port(), _free_port(), _free_port()
        self.addCleanup(self._unlink, (inherited_port, port_a, port_b))
        # Engine a: tp=2; engine b: tp=1 in two pipeline stages.
        ranks = [(port_a, 2, 1, 0, 0), (port_a, 2, 1, 1, 0)]
        ranks += [(port_b, 1, 2, 0, 0), (port_b, 1, 2, 0, 1)]
        inherited = {"MASTER_ADDR": "localhost", "MASTER_PORT": str(inherited_port)}
        cpu = min(os.sched_getaffinity(0))
        environ = {"SGLANG_CPU_OMP_THREADS_BIND": f"{cpu}|{cpu}", **inherited}
        environ["SGLANG_NCCL_SO_PATH"] = os.devnull  # as on CPU-only torch: no NCCL
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        with mock.patch.dict(os.environ, environ):
            for index, rank in enumerate(ranks):
                process = context.Process(target=_run_rank, args=(queue, index, *rank))
                process.start()
                self.addCleanup(process.join)
                self.addCleanup(process.kill)  # once it has reported, a rank is done
        reports = [queue.get(timeout=300) for _ in ranks]
        reports.sort(key=lambda report: report["index"])
        self.assertEqual([report.get("error") for report in reports], [None] * 4)
        self.assertEqual([len(report["calls"]) for report in reports], [1] * 4)
        calls = [report["calls"][0] for report in reports]
        segments = [call["segment"] for call in calls]

        with self.subTest("MASTER_* as inherited, LOCAL_SIZE = tp_size"):
            for report in reports:
                expected = {**inherited, "LOCAL_SIZE": str(report["tp_size"])}
                self.assertEqual(report["environ"], expected)
        with self.subTest("each engine and stage maps only its own segments"):
            self.assertEqual(len(set(segments)), len(reports), segments)
            # Stage 0 keeps the kernel's names, from the engine's own address.
            own = [f"{PREFIX}127.0.0.1_{port_a}_0", f"{PREFIX}127.0.0.1_{port_a}_1"]
            self.assertEqual(segments[:3], own + [f"{PREFIX}127.0.0.1_{port_b}_0"])
            pids = [report["pid"] for report in reports]
            expected = [pids[:2], pids[:2], pids[2:3], pids[3:]]
            self.assertEqual([call["pids"] for call in calls], expected)
        with self.subTest("no segment is left once the groups are built"):
            self.assertEqual(sorted(set(segments) & set(os.listdir(SHM_DIR))), [])

    @staticmethod
    def _unlink(ports):
        for name in os.listdir(SHM_DIR):
            if name.startswith(PREFIX) and any(f"_{p}_" in name for p in ports):
                os.unlink(os.path.join(SHM_DIR, name))


if __name__ == "__main__":
    unittest.main()
