"""Moved into ``resolve``; importable from here until the callers follow."""

from sglang.srt.placement.resolve import HostCapabilities  # noqa: F401
