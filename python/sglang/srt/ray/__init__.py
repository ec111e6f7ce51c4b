"""Scheduler ranks as Ray actors: ``scheduler_actor`` (what runs on a node) and ``engine`` (the launcher).

Nothing is imported here, so that ``import sglang.srt.ray`` does not import Ray.
"""
