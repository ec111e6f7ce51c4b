"""Build sglang's CPU kernel (sgl_kernel's ``common_ops``) with upstream_prs' kernel patches.

    .venv/bin/python scripts/build_cpu_kernel.py SGLANG_CHECKOUT OUT_DIR [--jobs N]

SGLANG_CHECKOUT is an sglang source tree with the CPU kernel in
``python/sglang/kernels/aot`` (upstream main of 2026-08-23, the tree the patch is
written for). It is only read: its kernel sources are copied into a temporary
directory, the kernel pull requests of ``upstream_prs/`` applied there in order with
``git apply`` (their kernel files only), and the kernel built there with CMake and
Ninja against the torch of the Python that runs this script. By default only what the
shared-memory collective needs is built (about a minute on 2 cores; ``--full``: every
op, about 20 minutes).
``--portable`` builds for any x86-64 host (AVX2 and older too): the AVX-512 reduce
header ``x86_64/shm.h`` is replaced by ``tests/kernel/portable_shm.h`` (the same four
functions in plain C++) and the ``-march=x86-64-v4``/``-mavx512*``/``-mamx-*`` options
by ``-march=x86-64``. It is for tests and measurements of the set-up and collectives'
control flow, not for serving.
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
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KERNEL = Path("python/sglang/kernels/aot")
#: The pull requests in upstream_prs/ that change the kernel, in order.
PATCHES = [
    patch
    for patch in sorted((REPO / "upstream_prs").glob("*/fix.patch"))
    if f" a/{KERNEL}/" in patch.read_text()
]
# What the build needs from the system, and the Debian package that brings it.
NEEDS = {"g++": "g++", "cmake": "cmake", "ninja": "ninja-build", "git": "git"}
NUMA_HEADER = Path("/usr/include/numa.h")
# (file, text, replacement): the build copy's edits; each text must be there.
CMAKE_EDITS = (
    ("CMakeLists.txt", "set(CMAKE_CXX_STANDARD 17)", "set(CMAKE_CXX_STANDARD 20)"),
    ("CMakeLists.txt", "USE_SABI ${SKBUILD_SABI_VERSION} ", ""),
)
#: The minimal build: the shared-memory collective's sources and the thread binding,
#: registered by a file this script generates from the checkout's own
#: ``torch_extension_cpu.cpp`` (those ops' declarations, ``m.def``/``m.impl`` lines).
MINIMAL_SOURCES = ("interface.cpp", "shm.cpp", "numa_utils.cpp")
MINIMAL_OPS = ("initialize", "shm_allreduce", "shm_allgather",
               "shm_allgather_into_tensor", "shm_reduce_scatter_tensor",
               "init_cpu_threads_env")  # fmt: skip
#: What ``--portable`` changes: the reduce header, and the x86-64 compile options.
PORTABLE_HEADER = REPO / "tests" / "kernel" / "portable_shm.h"
AVX512_OPTIONS = ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile",
                  "-mamx-bf16", "-mamx-int8")  # fmt: skip
SOURCES_GLOB = 'file(GLOB_RECURSE SOURCES "${CMAKE_CURRENT_SOURCE_DIR}/*.cpp")'
REGISTRATION = "torch_extension_cpu.cpp"
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


def registration(text: str, ops: tuple[str, ...]) -> str:
    """``torch_extension_cpu.cpp`` cut to ``ops``: its includes, each op's one-line
    declaration, its registration blocks holding only those ops' ``m.def``/``m.impl``
    lines, and its ``REGISTER_EXTENSION`` line. Each op must be found."""
    names = "|".join(sorted(ops, key=len, reverse=True))  # the longest name first
    # an op's declaration, or its overload's (initialize.group: initialize_group)
    declared = re.compile(rf"^[A-Za-z].*\b({names})\w*\(.*\);$")
    registered = re.compile(rf'^\s*m\.(def|impl)\("({names})[(".]')
    out: list[str] = []
    blocks: list[list[str]] = []
    found: dict[str, set[str]] = {op: set() for op in ops}
    for line in text.splitlines():
        if line.startswith(("#include", "REGISTER_EXTENSION(")):
            out.append(line)
        elif line.startswith("TORCH_LIBRARY"):
            blocks.append([line])
        elif line == "}" and blocks and blocks[-1][-1] != "}":
            blocks[-1].append(line)
        elif match := declared.match(line):
            found[match[1]].add("declaration")
            out.append(line)
        elif blocks and blocks[-1][-1] != "}" and (match := registered.match(line)):
            found[match[2]].add(match[1])
            blocks[-1].append(line)
    missing = [op for op, kinds in found.items() if not {"declaration", "def"} <= kinds]
    if missing:
        raise BuildError(
            f"{REGISTRATION}: no one-line declaration and m.def of {missing}; this "
            f"script knows the CPU kernel of upstream main of 2026-08-23"
        )
    kept = [line for block in blocks if len(block) > 2 for line in block]
    extension = [line for line in out if line.startswith("REGISTER_EXTENSION(")]
    body = [line for line in out if line not in extension]
    return "\n".join(["// Generated by build_cpu_kernel.py from the checkout's "
                      f"{REGISTRATION}: {', '.join(ops)}.", *body, *kept,
                      *extension, ""])  # fmt: skip


def copy_sources(
    checkout: Path, src: Path, *, minimal: bool, patches: list[Path],
    portable: bool = False,
) -> Path:  # fmt: skip
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
    for patch in patches:
        command = ["git", "apply", f"--include={KERNEL}/*", str(patch)]
        done = subprocess.run(command, cwd=src, env=env, capture_output=True,
                              text=True)  # fmt: skip
        if done.returncode != 0:
            raise BuildError(
                f"{patch.parent.name}/{patch.name} does not apply to {checkout} (it is "
                f"written for upstream main of 2026-08-23, commit cce0a1244b):\n"
                f"{done.stderr}"
            )
    cmake_dir = src / KERNEL / "csrc" / "cpu"
    for name, text, replacement in CMAKE_EDITS:
        edit(cmake_dir / name, text, replacement)
    if portable:
        shutil.copy2(PORTABLE_HEADER, cmake_dir / "x86_64" / "shm.h")
        for option in AVX512_OPTIONS:
            portable_option = "-march=x86-64" if option.startswith("-march") else ""
            edit(cmake_dir / "CMakeLists.txt", f"{option}\n", f"{portable_option}\n")
    if minimal:
        generated = cmake_dir / "minimal_registration.cpp"
        text = (cmake_dir / REGISTRATION).read_text()
        generated.write_text(registration(text, MINIMAL_OPS))
        # and any source the patches add beside them (the group set-up's own file)
        added = [p for p in sorted(cmake_dir.glob("shm_*.cpp")) if p.name != "shm.cpp"]
        sources = [cmake_dir / name for name in MINIMAL_SOURCES] + added + [generated]
        edit(cmake_dir / "CMakeLists.txt", SOURCES_GLOB,
             f"set(SOURCES {' '.join(str(path) for path in sources)})")  # fmt: skip
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


def build(
    checkout: Path, out: Path, jobs: int, work: Path, *, minimal: bool,
    patches: list[Path], portable: bool = False,
) -> Path:  # fmt: skip
    cmake_dir = copy_sources(checkout, work / "src", minimal=minimal, patches=patches,
                             portable=portable)  # fmt: skip
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
    parser.add_argument("--full", action="store_true",
                        help="every op (about 20 min on 2 cores); by default only "
                        "the shared-memory collective and thread binding (about 1 min)")
    parser.add_argument("--patch", type=Path, action="append", dest="patches",
                        help="apply this patch instead of the project's (repeatable)")
    parser.add_argument("--unpatched", action="store_true",
                        help="apply no patch: the released kernel")
    parser.add_argument("--portable", action="store_true",
                        help="any x86-64 host: tests/kernel/portable_shm.h for the "
                        "AVX-512 reduce, -march=x86-64 (tests and measurements)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: expected 1 or more")
    patches = [] if args.unpatched else args.patches or PATCHES
    started = time.monotonic()
    try:
        check_system()
        with tempfile.TemporaryDirectory(prefix="sgl-cpu-kernel-") as work:
            library = build(args.checkout.resolve(), args.out.resolve(), args.jobs,
                            Path(work), minimal=not args.full,
                            patches=patches, portable=args.portable)  # fmt: skip
    except BuildError as exc:
        print(f"build_cpu_kernel: {exc}", file=sys.stderr)
        return 2
    minutes = (time.monotonic() - started) / 60
    print(f"built {library} in {minutes:.1f} min; run the kernel tests with "
          f"SGLANG_CPU_KERNEL={library}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
