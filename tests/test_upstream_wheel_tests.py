"""Tests that ship in the sglang 0.5.23 wheel, run unchanged against the overlaid package."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from conftest import full_import_env

PACKAGE = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
GPU_WORKER_TESTS = (
    PACKAGE / "multimodal_gen" / "test" / "unit" / "test_gpu_worker_cpu_threads.py"
)


def test_gpu_worker_numa_binding_tests_pass(tmp_path: Path) -> None:
    """multimodal_gen's TestWorkerNumaBinding patches numa_utils' private helpers and calls the worker's bind.

    Its module imports ``sglang.test.test_utils``, which imports Hugging Face ``datasets`` (not in the
    pinned environment) for benchmarks these tests never run: a stand-in module fills that import only.
    """
    stand_ins = tmp_path / "stand_ins"
    stand_ins.mkdir()
    (stand_ins / "datasets.py").write_text(
        "def load_dataset(*args, **kwargs):\n    raise NotImplementedError\n"
    )
    env = full_import_env()
    env["PYTHONPATH"] = str(stand_ins)
    cmd = [sys.executable, "-m", "pytest", str(GPU_WORKER_TESTS), "-k", "TestWorkerNumaBinding", "-q",
           "-p", "no:cacheprovider", "-W", "ignore"]  # fmt: skip
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "4 passed" in out.stdout.splitlines()[-1], out.stdout[-2000:]
