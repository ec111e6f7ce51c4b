"""Linux cpulist text ("0-3,8,10-11") to and from sets of integers."""

from __future__ import annotations

import itertools
import re
from typing import Iterable

MAX_CPUS = 8192  # Linux's largest CONFIG_NR_CPUS (x86-64 MAXSMP)
MAX_CPULIST_CHARS = 64 * 1024  # every even CPU id below MAX_CPUS, one by one: 20 KiB

_NUMBER = r"[ \t]*([0-9]+)[ \t]*"
_PART_RE = re.compile(rf"{_NUMBER}(?:-{_NUMBER})?(?::{_NUMBER})?")


def elide(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}...({len(text) - 2 * half} characters)...{text[-half:]}"


def shown(value: object, *, limit: int = 120, quote: bool = True) -> str:
    """``value`` escaped like ``repr`` and elided: safe in a one-line message."""
    escaped = repr(elide(str(value), limit))
    return escaped if quote else escaped[1:-1]


def parse_cpulist(text: str, *, what: str = "cpulist") -> frozenset[int]:
    """``"0-3,8,10-11:2"``; "" is the empty set. ``what`` names the source in the error
    (the bare reason is its ``__cause__``); every number is bounded before a range."""
    stripped = text.strip()
    if len(stripped) > MAX_CPULIST_CHARS:
        raise ValueError(
            f"{what}: {shown(stripped)} is {len(stripped)} characters long; a list "
            f"of CPUs below {MAX_CPUS} needs at most {MAX_CPULIST_CHARS}"
        )
    present = bytearray(MAX_CPUS)  # ranges marked in C, read back to the last CPU only
    for part in stripped.split(",") if stripped else ():
        try:
            cpus = _parse_part(part.strip())
        except ValueError as exc:
            raise ValueError(
                f"{what}: {shown(part.strip())} in {shown(stripped)} is not a CPU "
                f"number or range; expected a list such as '0-3,8' ({exc})"
            ) from exc
        present[cpus.start : cpus.stop : cpus.step] = b"\x01" * len(cpus)
    return frozenset(itertools.compress(range(MAX_CPUS), present.rstrip(b"\x00")))


def _parse_part(part: str) -> range:
    match = _PART_RE.fullmatch(part)
    if match is None:
        raise ValueError("expected N, N-M or N-M:STRIDE in ASCII digits")
    lo, hi, stride = map(_cpu_number, (match[1], match[2] or match[1], match[3] or "1"))
    if stride == 0 or hi < lo:
        raise ValueError("a range must ascend, with a positive stride")
    return range(lo, hi + 1, stride)


def _cpu_number(digits: str) -> int:
    number = digits.lstrip("0") or "0"
    if len(number) <= len(str(MAX_CPUS)) and int(number) < MAX_CPUS:
        return int(number)
    largest = f"the largest CPU id Linux supports ({MAX_CPUS - 1})"
    raise ValueError(f"{shown(number, quote=False)} is above {largest}")


def format_cpulist(cpus: Iterable[int]) -> str:
    """The shortest ascending cpulist: ``{0, 1, 2, 3, 8}`` -> ``"0-3,8"``."""
    runs = itertools.groupby(enumerate(sorted(set(cpus))), lambda p: p[1] - p[0])
    spans = [[cpu for _, cpu in run] for _, run in runs]
    return ",".join(f"{s[0]}-{s[-1]}" if len(s) > 1 else str(s[0]) for s in spans)
