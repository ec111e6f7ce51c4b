"""Typed environment variables read by the placement and bootstrap code (``envs.NAME.get()``), and ``scoped_environ`` to set some for one block."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Generic, Iterator, Mapping, Optional, Sequence, TypeVar

T = TypeVar("T")

_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")


class EnvError(ValueError):
    """An environment variable holds a value its field does not accept."""


class EnvField(Generic[T]):
    """One environment variable: its name, its default and how its text is parsed."""

    def __init__(self, default: T, *, name: str = "") -> None:
        self.default = default
        self.name = name

    def __set_name__(self, owner: type, name: str) -> None:
        if not self.name:
            self.name = name

    def __get__(self, instance: object, owner: type) -> "EnvField[T]":
        return self

    def parse(self, text: str) -> T:
        raise NotImplementedError

    def format(self, value: T) -> str:
        return str(value)

    def is_set(self) -> bool:
        return self.name in os.environ

    def get(self) -> T:
        text = os.environ.get(self.name)
        if text is None:
            return self.default
        return self.parse(text)

    def get_raw(self) -> Optional[str]:
        return os.environ.get(self.name)

    @contextlib.contextmanager
    def override(self, value: Optional[T]) -> Iterator[None]:
        """Set (or, with None, unset) the variable for the duration of a ``with`` block."""
        previous = os.environ.get(self.name)
        if value is None:
            os.environ.pop(self.name, None)
        else:
            text = value if isinstance(value, str) else self.format(value)
            os.environ[self.name] = text
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop(self.name, None)
            else:
                os.environ[self.name] = previous

    def _error(self, text: str, accepted: str) -> EnvError:
        return EnvError(f"{self.name}={text!r} is not valid: expected {accepted}.")


class EnvBool(EnvField[bool]):
    def parse(self, text: str) -> bool:
        word = text.strip().lower()
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
        raise self._error(
            text, f"one of {', '.join(_TRUE_WORDS)} (true) or {', '.join(_FALSE_WORDS)} (false)"
        )

    def format(self, value: bool) -> str:
        return "1" if value else "0"


class EnvStr(EnvField[str]):
    def parse(self, text: str) -> str:
        return text


class EnvNonEmptyStr(EnvField[str]):
    def parse(self, text: str) -> str:
        if not text.strip():
            raise self._error(text, "a non-empty value")
        return text


class EnvOptionalStr(EnvField[Optional[str]]):
    def parse(self, text: str) -> Optional[str]:
        return text or None


class EnvChoice(EnvField[str]):
    def __init__(self, default: str, choices: Sequence[str], *, name: str = "") -> None:
        super().__init__(default, name=name)
        self.choices = tuple(choices)

    def parse(self, text: str) -> str:
        word = text.strip().lower()
        if word not in self.choices:
            raise self._error(text, f"one of {', '.join(self.choices)}")
        return word


class Envs:
    """The environment variables of this subsystem, each read on every ``get()``."""

    SGLANG_NUMA_BIND_V2 = EnvBool(True)
    SGLANG_AUTO_NUMA_BIND = EnvBool(True)
    SGLANG_CRASH_ON_NUMA_BIND_FAILURE = EnvBool(False)
    SGLANG_CPU_OMP_THREADS_BIND = EnvNonEmptyStr("all")
    SGLANG_NUMA_AFFINITY_MODE = EnvChoice("node", ("node", "exclusive", "socket"))
    SGLANG_SYSFS_ROOT = EnvNonEmptyStr("/sys")
    SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE = EnvOptionalStr(None)


envs = Envs()


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
