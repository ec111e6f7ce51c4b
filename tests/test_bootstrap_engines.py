"""The helpers that run CPU engines' ranks through sglang's real bootstrap, under the
names other test modules import from here; they live in ``bootstrap_engines``, and
the bootstrap tests in ``test_bootstrap``."""

from __future__ import annotations

from bootstrap_engines import (  # noqa: F401
    DRIVER,
    SHM,
    _driver_env,
    _free_ports,
    _signal_and_wait,
    run_ranks,
    serving,
)
