"""A scheduler target whose module is slow to import, as a real scheduler's (torch, transformers) is.

A spawned rank imports this module when it unpickles its target; the sleep stands in
for the seconds such imports take, the window in which a rank is starting but has not
yet run any of its own code.
"""

from __future__ import annotations

import multiprocessing
import threading
import time

IMPORT_S = 1.0

# Only in a spawned rank (its process name is set before its target is unpickled), not in the launcher.
if multiprocessing.current_process().name != "MainProcess":
    time.sleep(IMPORT_S)


class _Hanging:
    def ready_info(self):
        threading.Event().wait()


def hanging_target(*, server_args, placement, rank):
    return _Hanging()
