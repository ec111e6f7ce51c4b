"""Makes ``import sglang.srt.placement`` skip sglang's own ``__init__`` (torch, transformers: minutes under emulation).

Import this first in a script that runs inside the emulated VM. The ``sglang``
package is registered as a bare package on its real directory, so its
submodules import as usual while ``sglang/__init__.py`` never runs. A spawned
child re-runs the script's top level before it unpickles anything, so it gets
the same treatment.
"""

from __future__ import annotations

import importlib.util
import sys
import types


def install() -> None:
    if "sglang" in sys.modules:
        return
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed in this interpreter: run scripts/setup.sh first")
    package = types.ModuleType("sglang")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["sglang"] = package


install()
