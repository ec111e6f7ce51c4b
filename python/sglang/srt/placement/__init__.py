"""Where each scheduler rank runs: one ProcessPlacement, resolved on its host."""

from sglang.srt.placement.cpulist import format_cpulist  # noqa: F401  (scripts/demo.sh)
