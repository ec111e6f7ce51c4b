"""Operator tools on top of placement: ``plan``, ``verify`` and ``capture``.

``python -m sglang.srt.placement_tools plan|verify|capture``. Nothing in
placement, the launch glue or sglang's own modules imports this package.
"""
