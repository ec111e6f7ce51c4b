"""Makes ``import sglang.srt.<module>`` skip sglang's own ``__init__`` (torch, transformers, Hugging Face patches).

That ``__init__`` costs about 8 s per process here and minutes under emulation,
for nothing placement or the launchers use. Importing this module registers the
``sglang`` package as a bare package on its real directory, so its submodules
import as usual while ``sglang/__init__.py`` never runs. The test suite loads it
in every interpreter it starts (``sitecustomize``); scripts that run inside the
emulated VM import it first.
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
    package.__spec__ = spec
    package.__file__ = spec.origin
    sys.modules["sglang"] = package


install()
