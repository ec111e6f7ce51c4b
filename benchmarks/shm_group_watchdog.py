"""How long a real tp=2 CPU engine lives on after one of its ranks is killed in the
shared-memory set-up: from the SIGKILL until every process of the engine has exited.

    .venv/bin/python benchmarks/shm_group_watchdog.py --kernel SO --sglang DIR \
        [--steps before-initialize,before-naming,named,set-up,all-reduce] [--cap 180]

SO is a CPU kernel that ``scripts/build_cpu_kernel.py --portable`` built (runs on any
x86-64 host); DIR holds the ``sglang`` package to run, with the stack's Python applied
(first on ``PYTHONPATH``, before the ``PYTHONPATH`` this script is given: sglang's own
dependencies it lacks, such as ``xgrammar``, can come from there). The engine is sglang's own launch path, ``Engine(device="cpu",
tp_size=2)`` (``launch_server``'s engine, without the HTTP server) on a tiny random Llama
(``tests/data/tiny_llama``, ``--load-format dummy``), gloo (``SGLANG_NCCL_SO_PATH``
points nowhere: PyPI's torch is a CUDA build) and sglang's AMX gate made true only
where the shared-memory all-reduce reads it (bootstrap's flag and ``is_shm_available``;
this host has no AMX, and the model's layers stay on their non-AMX paths).

TP rank 1 stops itself (SIGSTOP) at one step, and is then SIGKILLed:

* ``before-initialize``: at sgl_kernel's ``initialize`` call, before it runs;
* ``before-naming``: inside it, before its segment has a name (``linkat``);
* ``named``: right after its segment is named, before all ranks arrived;
* ``set-up``: once ``initialize`` returned;
* ``all-reduce``: once ``initialize`` returned, while rank 0 is in its first
  ``shm_allreduce`` (both ranks call one there).

For each step it prints the seconds until the last process of the engine exited (or
``>CAP`` and then kills them), the survivor's sgl_kernel error if it logged one, and what
the engine left in ``/dev/shm``. The stops are ``tests/kernel/shm_fault.c`` (built here
with gcc) and a wrapper of the op in the ``sgl_kernel`` module this script writes.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS = ("before-initialize", "before-naming", "named", "set-up", "all-reduce")

SITECUSTOMIZE = '''
import importlib.machinery, os, sys

def _after_import(name, patch):
    """Runs patch(module) right after ``name`` is first imported."""
    class Finder:
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            run = spec.loader.exec_module
            def exec_module(module):
                run(module)
                patch(module)
            spec.loader.exec_module = exec_module
            return spec
    sys.meta_path.insert(0, Finder())

def _shm(dtype, world_size, local_size):
    import torch
    return dtype in (torch.bfloat16, torch.float16, torch.float) and world_size == local_size

if os.environ.get("SHM_WATCHDOG_BENCH"):
    _after_import("sglang.srt.distributed.bootstrap",
                  lambda m: setattr(m, "_is_cpu_amx_available", True))
    _after_import("sglang.srt.distributed.parallel_state",
                  lambda m: setattr(m, "is_shm_available", _shm))
    import sgl_kernel  # noqa: F401
'''

SGL_KERNEL = '''
import os, signal, torch

torch.ops.load_library(os.environ["SHM_WATCHDOG_KERNEL"])
STEP = os.environ.get("SHM_WATCHDOG_STEP", "")


class _Stops:
    """sgl_kernel's initialize (and its overloads), stopping rank 1 at STEP."""

    def __init__(self, op):
        self.op = op

    def __getattr__(self, name):
        found = getattr(self.op, name)
        return _Stops(found) if name == "group" else found

    def __call__(self, *args):
        victim = len(args) > 2 and args[1] == 1
        if victim and STEP == "before-initialize":
            os.kill(os.getpid(), signal.SIGSTOP)
        result = self.op(*args)
        if victim and STEP in ("set-up", "all-reduce"):
            os.kill(os.getpid(), signal.SIGSTOP)
        if len(args) > 2 and STEP == "all-reduce":
            torch.ops.sgl_kernel.shm_allreduce(torch.ones(1024, dtype=torch.bfloat16), 0)
        return result


torch.ops.sgl_kernel.initialize = _Stops(torch.ops.sgl_kernel.initialize)


def __getattr__(name):  # sglang imports more of sgl_kernel than this build has
    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: not in this minimal build")

    return missing
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree(root: int) -> set[int]:
    """``root`` and its descendants now."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += [child for child, parent in parents.items() if parent == pid]
    return found


def state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def run_step(step: str, args, work: Path) -> str:
    port, dist_port, engine = free_port(), free_port(), set()
    path = [str(args.sglang), str(work), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path),
           "SHM_WATCHDOG_BENCH": "1", "SHM_WATCHDOG_KERNEL": str(args.kernel),
           "SHM_WATCHDOG_STEP": step, "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so",
           "SGLANG_USE_CPU_ENGINE": "1", "SGLANG_CPU_OMP_THREADS_BIND": "0|1"}  # fmt: skip
    if step in ("before-naming", "named"):
        env.update(LD_PRELOAD=str(work / "libshmfault.so"), SHM_FAULT_SUFFIX="_1",
                   SHM_FAULT_STOP="linkat" if step == "before-naming" else "linkat_after")  # fmt: skip
    log = work / f"{step}.log"
    engine_args = dict(model_path=str(work / "model"), load_format="dummy", device="cpu",
                       tp_size=2, attention_backend="torch_native",
                       skip_tokenizer_init=True, port=port,
                       dist_init_addr=f"127.0.0.1:{dist_port}")  # fmt: skip
    command = [sys.executable, "-c", "import sys; from sglang.srt.entrypoints.engine "
               f"import Engine; Engine(**{engine_args!r}); sys.exit(3)"]  # fmt: skip
    with open(log, "w") as out:
        server = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 900  # a loaded 2-core host starts slowly
        victim = None
        while victim is None:
            if server.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-12:])
                return f"{step:18} the engine never reached the step:\n{tail}"
            victim = next((p for p in tree(server.pid) if state(p) == "T"), None)
            time.sleep(0.05)
        engine = tree(server.pid)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        while any(state(p) not in ("gone", "Z") for p in engine) and (
            time.monotonic() - killed < args.cap
        ):
            server.poll()
            time.sleep(0.02)
        seconds = time.monotonic() - killed
        alive = [p for p in engine if state(p) not in ("gone", "Z")]
        took = f">{args.cap:.0f} s ({len(alive)} alive)" if alive else f"{seconds:.1f} s"
    finally:
        try:
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server.wait()
    text = log.read_text(errors="replace")
    errors = re.findall(r"sgl_kernel(?:::initialize)?: ([^\n]*)", text)
    shown = errors[0][:110] if errors else "-"
    for path in Path("/dev/shm").iterdir():  # sglang's own queues, which a kill leaves
        if any(path.name.startswith(f"sgl_shm_mq_{pid}_") for pid in engine):
            path.unlink()
    left = [p for p in Path("/dev/shm").iterdir() if f"_{dist_port}_" in p.name]
    size = sum(p.stat().st_size for p in left)
    for path in left:
        path.unlink()
    return f"{step:18} {took:>16}  {len(left)} left ({size >> 10} KiB)  survivor: {shown}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", type=Path, required=True)
    parser.add_argument("--sglang", type=Path, required=True)
    parser.add_argument("--steps", default=",".join(STEPS))
    parser.add_argument("--cap", type=float, default=180.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="shm-watchdog-") as tmp:
        work = Path(tmp)
        (work / "sitecustomize.py").write_text(SITECUSTOMIZE)
        (work / "sgl_kernel").mkdir()
        (work / "sgl_kernel" / "__init__.py").write_text(SGL_KERNEL)
        shutil.copytree(REPO / "tests" / "data" / "tiny_llama", work / "model")

        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o",
                        str(work / "libshmfault.so"),
                        str(REPO / "tests" / "kernel" / "shm_fault.c"), "-ldl"],
                       check=True)  # fmt: skip
        print(f"kernel {args.kernel}, sglang {args.sglang}")
        for step in args.steps.split(","):
            print(run_step(step, args, work), flush=True)


if __name__ == "__main__":
    main()
