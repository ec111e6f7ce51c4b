"""Build sglang's CPU kernel (sgl_kernel's ``common_ops``) with this project's patch.

    .venv/bin/python scripts/build_cpu_kernel.py SGLANG_CHECKOUT OUT_DIR [--jobs N]

SGLANG_CHECKOUT is an sglang source tree with the CPU kernel in
``python/sglang/kernels/aot`` (upstream main of 2026-08-23, the tree the patch is
written for). It is only read: its kernel sources are copied into a temporary
directory, ``kernel/*.patch`` applied there with ``git apply``, and the kernel built
there with CMake and Ninja against the torch of the Python that runs this script.
OUT_DIR receives ``common_ops.<abi>.so``; point ``SGLANG_CPU_KERNEL`` at it (or at
OUT_DIR) to run the kernel tests.

Two changes are made to the build copy, never to the checkout or to torch: a C++20
build (torch 2.14's headers need it), and no stable-ABI option (CMake before 3.26
does not know it). With a CUDA build of torch, torch's CMake files are copied and
their CUDA part replaced by an empty ``torch::cudart`` target, so no CUDA toolkit is
needed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PATCHES = sorted((REPO / "kernel").glob("*.patch"))
KERNEL = Path("python/sglang/kernels/aot")
# What the build needs from the system, and the Debian package that brings it.
NEEDS = {"g++": "g++", "cmake": "cmake", "ninja": "ninja-build", "git": "git"}
NUMA_HEADER = Path("/usr/include/numa.h")
# (file, text, replacement): the build copy's edits; each text must be there.
CMAKE_EDITS = (
    ("CMakeLists.txt", "set(CMAKE_CXX_STANDARD 17)", "set(CMAKE_CXX_STANDARD 20)"),
    ("CMakeLists.txt", "USE_SABI ${SKBUILD_SABI_VERSION} ", ""),
)
CUDA_INCLUDE = 'include("${CMAKE_CURRENT_LIST_DIR}/public/cuda.cmake")'
CUDA_STANDIN = "add_library(torch::cudart INTERFACE IMPORTED)"


class BuildError(Exception):
    pass


def check_system() -> None:
    missing = [pkg for tool, pkg in NEEDS.items() if shutil.which(tool) is None]
    if not NUMA_HEADER.exists():
        missing.insert(0, "libnuma-dev")
    if missing:
        raise BuildError(
            f"missing build packages: {', '.join(missing)}; install them with: "
            f"apt-get install -y {' '.join(missing)}"
        )


def edit(path: Path, text: str, replacement: str) -> None:
    content = path.read_text()
    if text not in content:
        raise BuildError(
            f"{path}: expected the text {text!r}; this script knows the CPU kernel "
            f"of upstream main of 2026-08-23"
        )
    path.write_text(content.replace(text, replacement, 1))


def copy_sources(checkout: Path, src: Path) -> Path:
    """The checkout's kernel sources, patched, under ``src``; returns the CMake dir."""
    kernel = checkout / KERNEL
    if not (kernel / "csrc" / "cpu" / "CMakeLists.txt").is_file():
        raise BuildError(
            f"{checkout}: no {KERNEL}/csrc/cpu/CMakeLists.txt; name the root of an "
            f"sglang source checkout (upstream main of 2026-08-23)"
        )
    for part in ("csrc", "include"):
        shutil.copytree(kernel / part, src / KERNEL / part, symlinks=True)
    # Keeps git from taking an enclosing repository's root for the patch's root.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(src.parent)}
    for patch in PATCHES:
        done = subprocess.run(["git", "apply", str(patch)], cwd=src, env=env,
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0:
            raise BuildError(
                f"{patch.name} does not apply to {checkout} (it is written for "
                f"upstream main of 2026-08-23, commit cce0a1244b):\n{done.stderr}"
            )
    cmake_dir = src / KERNEL / "csrc" / "cpu"
    for name, text, replacement in CMAKE_EDITS:
        edit(cmake_dir / name, text, replacement)
    return cmake_dir


def torch_cmake_dir(work: Path) -> Path:
    """Torch's CMake package, as it is or (a CUDA build) as a copy without CUDA."""
    try:
        import torch
    except ImportError:
        raise BuildError(
            f"{sys.executable} has no torch: run this script with the Python of the "
            f"environment the kernel is for (e.g. .venv/bin/python)"
        ) from None

    share = Path(torch.utils.cmake_prefix_path)
    if torch.version.cuda is None:
        return share / "Torch"
    root = work / "torch"
    shutil.copytree(share, root / "share" / "cmake")
    for part in ("include", "lib"):
        (root / part).symlink_to(share.parents[1] / part)
    edit(root / "share/cmake/Caffe2/Caffe2Config.cmake", CUDA_INCLUDE, CUDA_STANDIN)
    return root / "share" / "cmake" / "Torch"


def build(checkout: Path, out: Path, jobs: int, work: Path) -> Path:
    cmake_dir = copy_sources(checkout, work / "src")
    build_dir = work / "build"
    configure = ["cmake", "-G", "Ninja", "-S", str(cmake_dir), "-B", str(build_dir),
                 "-DCMAKE_BUILD_TYPE=Release", f"-DTorch_DIR={torch_cmake_dir(work)}",
                 f"-DPython_EXECUTABLE={sys.executable}"]  # fmt: skip
    for command in (configure, ["cmake", "--build", str(build_dir), "-j", str(jobs)]):
        if subprocess.run(command).returncode != 0:
            raise BuildError(f"`{' '.join(command[:2])}` failed; see its output above")
    libraries = sorted(build_dir.glob("common_ops*.so"))
    if len(libraries) != 1:
        raise BuildError(f"expected one common_ops*.so in {build_dir}: {libraries}")
    [library] = libraries
    out.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy2(library, out / library.name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="sglang source checkout (read)")
    parser.add_argument("out", type=Path, help="directory for common_ops*.so")
    parser.add_argument("--jobs", type=int, default=1, help="compile jobs (1)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: expected 1 or more")
    started = time.monotonic()
    try:
        check_system()
        with tempfile.TemporaryDirectory(prefix="sgl-cpu-kernel-") as work:
            library = build(args.checkout.resolve(), args.out.resolve(), args.jobs,
                            Path(work))  # fmt: skip
    except BuildError as exc:
        print(f"build_cpu_kernel: {exc}", file=sys.stderr)
        return 2
    minutes = (time.monotonic() - started) / 60
    print(f"built {library} in {minutes:.1f} min; run the kernel tests with "
          f"SGLANG_CPU_KERNEL={library}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
