"""Test harness: every interpreter the suite starts imports sglang's submodules without running ``sglang/__init__``.

The suite puts this directory on ``PYTHONPATH`` (tests/conftest.py), so spawned
scheduler ranks, Ray workers and CLI subprocesses load it at start-up; see
``sglang_light`` for why. Tests that must see the package exactly as users
import it start their interpreter without this directory on the path.

Two more modules here serve upstream's tests as they are written: ``sgl_kernel`` (the
CPU kernel named by ``SGLANG_CPU_KERNEL``; without it the import fails) and a stand-in
for Hugging Face ``datasets``, which ``sglang.test.test_utils`` imports.

Two variables of the harness (never read by sglang) give a whole process tree a
host this machine is not: ``PLACEMENT_TESTS_SYSFS`` points placement's sysfs seam
(``placement.topology.SYSFS_ROOT``) at a fake tree, and
``PLACEMENT_TESTS_PLATFORM=cuda`` makes ``numa_utils`` see a CUDA platform.
"""

import sglang_light

sglang_light.fake_host_from_environment()
