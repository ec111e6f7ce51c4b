"""``scoped_environ``: set environment variables for one block and put the previous values back, thread-safely."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator, Mapping


# os.environ is process-wide: two threads scoping the same names would restore
# each other's values, so every scoped change holds this lock for its block.
_SCOPED_ENVIRON_LOCK = threading.RLock()


@contextlib.contextmanager
def scoped_environ(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in the process environment for the ``with`` block only, then put
    back the previous values (or their absence), also on error."""
    with _SCOPED_ENVIRON_LOCK:
        previous = {name: os.environ.get(name) for name in values}
        try:
            os.environ.update(values)
            yield
        finally:
            for name, value in previous.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
