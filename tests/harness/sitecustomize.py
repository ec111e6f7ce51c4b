"""Test harness: every interpreter the suite starts imports sglang's submodules without running ``sglang/__init__``.

The suite puts this directory on ``PYTHONPATH`` (tests/conftest.py), so spawned
scheduler ranks, Ray workers and CLI subprocesses load it at start-up; see
``sglang_light`` for why. Tests that must see the package exactly as users
import it start their interpreter without this directory on the path.
"""

import sglang_light  # noqa: F401
