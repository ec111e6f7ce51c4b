"""scripts/build_cpu_kernel.py's refusals, which need no compiler: each names what is
wrong and the fix, exits 2, and leaves the checkout as it was."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "build_cpu_kernel.py"


def build(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, timeout=120, env=env)  # fmt: skip


def test_missing_build_tools_are_named_with_the_apt_get_line(tmp_path):
    done = build(str(tmp_path), str(tmp_path / "out"), env={"PATH": str(tmp_path)})
    assert done.returncode == 2
    assert "missing build packages:" in done.stderr
    assert "apt-get install -y" in done.stderr
    for package in ("g++", "cmake", "ninja-build", "git"):
        assert package in done.stderr
    assert not (tmp_path / "out").exists()


def test_a_directory_without_the_cpu_kernel_is_refused(tmp_path):
    (tmp_path / "checkout").mkdir()
    done = build(str(tmp_path / "checkout"), str(tmp_path / "out"))
    if "missing build packages" in done.stderr:
        return  # this host has no compiler: the refusal above is the one it gets
    assert done.returncode == 2
    assert "no python/sglang/kernels/aot/csrc/cpu/CMakeLists.txt" in done.stderr
    assert list((tmp_path / "checkout").iterdir()) == []


def test_a_checkout_the_patch_does_not_fit_is_refused_untouched(tmp_path):
    cpu = tmp_path / "checkout" / "python/sglang/kernels/aot/csrc/cpu"
    cpu.mkdir(parents=True)
    (cpu / "CMakeLists.txt").write_text("project(sgl_kernel)\n")
    (cpu / "shm.cpp").write_text("// not upstream's shm.cpp\n")
    (tmp_path / "checkout/python/sglang/kernels/aot/include").mkdir()
    before = {p: p.read_bytes() for p in cpu.iterdir()}
    done = build(str(tmp_path / "checkout"), str(tmp_path / "out"))
    if "missing build packages" in done.stderr:
        return
    assert done.returncode == 2
    assert "0002-cpu-shm-group/fix.patch does not apply" in done.stderr
    assert "commit cce0a1244b" in done.stderr
    assert {p: p.read_bytes() for p in cpu.iterdir()} == before
    assert not (tmp_path / "out").exists()
