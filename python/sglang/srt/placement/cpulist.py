"""Linux cpulist text ("0-3,8,10-11") to and from sets of integers."""

from __future__ import annotations

from typing import Iterable


class CpuListError(ValueError):
    """A cpulist string is malformed."""


def parse_cpulist(text: str, *, what: str = "cpulist") -> frozenset[int]:
    """Parse a Linux cpulist such as ``"0-3,8,10-11:2"``; an empty string is the empty set.

    ``what`` names the source of the text in error messages (a file or a setting).
    """
    result: set[int] = set()
    stripped = text.strip()
    if not stripped:
        return frozenset()
    for part in stripped.split(","):
        part = part.strip()
        try:
            result.update(_parse_part(part))
        except (ValueError, CpuListError) as exc:
            raise CpuListError(
                f"{what}: {part!r} in {text.strip()!r} is not a CPU number or range; "
                f"expected a list such as '0-3,8' ({exc})"
            ) from None
    return frozenset(result)


def _parse_part(part: str) -> range:
    if not part:
        raise CpuListError("empty item")
    stride = 1
    if ":" in part:
        part, stride_text = part.split(":", 1)
        stride = int(stride_text)
        if stride <= 0:
            raise CpuListError("stride must be positive")
    if "-" in part:
        lo_text, hi_text = part.split("-", 1)
        lo, hi = int(lo_text), int(hi_text)
    else:
        lo = hi = int(part)
    if lo < 0 or hi < lo:
        raise CpuListError("range must be ascending and non-negative")
    return range(lo, hi + 1, stride)


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


def parse_cpumask(text: str, *, what: str = "cpumask") -> frozenset[int]:
    """Parse a Linux hex mask such as ``"00000000,0000000f"`` (as in ``Cpus_allowed``)."""
    digits = text.strip().replace(",", "")
    try:
        value = int(digits, 16) if digits else 0
    except ValueError:
        raise CpuListError(f"{what}: {text.strip()!r} is not a hexadecimal CPU mask") from None
    return frozenset(i for i in range(value.bit_length()) if value >> i & 1)
