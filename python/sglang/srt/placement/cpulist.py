"""Linux cpulist text ("0-3,8,10-11") to and from sets of integers."""

from __future__ import annotations

import itertools
import re
from typing import Iterable

MAX_CPUS = 8192
"""CPU ids run from 0 to ``MAX_CPUS - 1``: 8192 is the largest ``CONFIG_NR_CPUS``
Linux allows (x86-64 ``MAXSMP``; other architectures allow fewer), so no kernel names
a CPU at or above it. A cpulist naming one is refused before any range is built."""

MAX_CPULIST_CHARS = 64 * 1024
"""The longest cpulist text parsed: every even CPU id below ``MAX_CPUS``, listed one by one, takes 20 KiB."""

_NUMBER = r"[ \t]*([0-9]+)[ \t]*"
_PART_RE = re.compile(rf"{_NUMBER}(?:-{_NUMBER})?(?::{_NUMBER})?")


class CpuListError(ValueError):
    """A cpulist string is malformed; ``reason`` says why without naming the source."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


def elide(text: str, limit: int) -> str:
    """``text``, cut in the middle when longer than ``limit`` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}...({len(text) - 2 * half} characters)...{text[-half:]}"


def shown(value: object, *, limit: int = 120, quote: bool = True) -> str:
    """``value`` as text safe for a one-line message: escaped like ``repr`` (NUL, newlines, escape
    sequences) and cut in the middle past ``limit`` characters; without quotes when ``quote`` is False.
    """
    escaped = repr(elide(str(value), limit))
    return escaped if quote else escaped[1:-1]


def parse_cpulist(text: str, *, what: str = "cpulist") -> frozenset[int]:
    """Parse a Linux cpulist such as ``"0-3,8,10-11:2"``; an empty string is the empty set.

    ``what`` names the source of the text in error messages (a file or a setting). Numbers are ASCII
    digits and CPU ids are below :data:`MAX_CPUS`; both are checked before any range is built.
    """
    stripped = text.strip()
    if not stripped:
        return frozenset()
    if len(stripped) > MAX_CPULIST_CHARS:
        raise CpuListError(
            f"{what}: {shown(stripped)} is {len(stripped)} characters long; a list of CPUs below {MAX_CPUS} "
            f"needs at most {MAX_CPULIST_CHARS}"
        )
    ranges: list[range] = []
    for part in stripped.split(","):
        part = part.strip()
        try:
            ranges.append(_parse_part(part))
        except CpuListError as exc:
            raise CpuListError(
                f"{what}: {shown(part)} in {shown(stripped)} is not a CPU number or range; "
                f"expected a list such as '0-3,8' ({exc})",
                reason=str(exc) if part == stripped else f"{shown(part)}: {exc}",
            ) from None
    if sum(map(len, ranges)) <= MAX_CPUS:
        return frozenset().union(*ranges)
    # Many overlapping ranges (each at most MAX_CPUS long): mark them in a bitmap, in C, instead.
    present = bytearray(MAX_CPUS)
    for r in ranges:
        present[r.start : r.stop : r.step] = b"\x01" * len(r)
    return frozenset(itertools.compress(range(MAX_CPUS), present))


def _parse_part(part: str) -> range:
    if not part:
        raise CpuListError("empty item")
    match = _PART_RE.fullmatch(part)
    if match is None:
        raise CpuListError("expected N, N-M or N-M:STRIDE in ASCII digits")
    lo_text, hi_text, stride_text = match.groups()
    lo = _cpu_number(lo_text)
    hi = lo if hi_text is None else _cpu_number(hi_text)
    stride = 1 if stride_text is None else _cpu_number(stride_text)
    if stride <= 0:
        raise CpuListError("stride must be positive")
    if hi < lo:
        raise CpuListError("range must be ascending and non-negative")
    return range(lo, hi + 1, stride)


def _cpu_number(digits: str) -> int:
    significant = digits.lstrip("0") or "0"
    if len(significant) > len(str(MAX_CPUS)) or int(significant) >= MAX_CPUS:
        raise CpuListError(
            f"{shown(significant, quote=False)} is above the largest CPU id Linux supports ({MAX_CPUS - 1})"
        )
    return int(significant)


def format_cpulist(cpus: Iterable[int]) -> str:
    """Format integers as the shortest ascending cpulist, e.g. ``{0,1,2,3,8}`` -> ``"0-3,8"``."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)
