"""Test harness: every interpreter the suite starts imports sglang's submodules without running ``sglang/__init__``.

The suite puts this directory on ``PYTHONPATH`` (tests/conftest.py), so spawned
scheduler ranks, Ray workers and CLI subprocesses load it at start-up; see
``sglang_light`` for why. Tests that must see the package exactly as users
import it start their interpreter without this directory on the path.

More modules here serve the tests: ``sgl_kernel`` (the CPU kernel named by
``SGLANG_CPU_KERNEL``; without it the import fails), a stand-in for Hugging Face
``datasets``, which ``sglang.test.test_utils`` imports, and ``rank_probe`` (scheduler
ranks started as sglang starts them, each reporting its binding), with its launcher
script ``launch_ranks``.

One variable of the harness (never read by sglang) gives a whole process tree a host
this machine is not: ``PLACEMENT_TESTS_PLATFORM=cuda`` makes ``numa_utils`` see a CUDA
platform whose GPUs are those of the stand-in NVML (tests/fakes/pynvml.py); the host's
sysfs is a fake tree mounted over /sys in a private mount namespace
(tests/fakehost.py).
"""

import sglang_light

sglang_light.fake_host_from_environment()
