"""``import sgl_kernel`` as upstream's CPU tests write it, for the CPU kernel that
scripts/build_cpu_kernel.py built: ``SGLANG_CPU_KERNEL`` names its ``common_ops*.so``
(or the directory holding it). Without it the import fails, and the tests that need
the kernel skip. (PyPI's sgl-kernel wheels are CUDA-only: no CPU ops.)"""

import os
from pathlib import Path

import torch

_named = os.environ.get("SGLANG_CPU_KERNEL", "")
if not _named:
    raise ImportError(
        "no CPU build of sgl_kernel: set SGLANG_CPU_KERNEL to the common_ops*.so "
        "that scripts/build_cpu_kernel.py built"
    )
_found = (
    sorted(Path(_named).glob("common_ops*.so"))
    if Path(_named).is_dir()
    else [Path(_named)]
)
if len(_found) != 1 or not _found[0].is_file():
    raise ImportError(
        f"SGLANG_CPU_KERNEL={_named!r}: expected a common_ops*.so file or a directory "
        f"holding exactly one; found {[str(f) for f in _found]}"
    )
torch.ops.load_library(str(_found[0]))
