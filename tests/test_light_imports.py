"""Placement and sglang's spawn path import nothing heavy: what runs inside the emulated VM stays quick.

``sglang.srt.utils`` itself imports torch in its ``__init__``; numa_utils, below it, does not.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HARNESS = Path(__file__).resolve().parent / "harness"
HEAVY = ("torch", "transformers", "sglang.srt.utils.common", "ray")


def test_placement_and_the_spawn_path_load_without_heavy_modules():
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(HARNESS)!r})\n"
        "import sglang_light\n"
        "import sglang.srt.placement, sglang.srt.placement.resolve, sglang.srt.placement_tools.verify\n"
        "import sglang.srt.placement.apply, sglang.srt.placement_tools.capture\n"
        "sglang_light.bare_package('sglang.srt.utils')\n"
        "import sglang.srt.utils.numa_utils\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
