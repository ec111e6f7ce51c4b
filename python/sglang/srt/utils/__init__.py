"""Utilities shared across the runtime.

Kept light on purpose: sglang-router imports ``is_port_available`` from here at
module load, so nothing imported here may pull in torch or other heavy modules.
"""

from sglang.srt.utils.network import is_port_available

__all__ = ["is_port_available"]
