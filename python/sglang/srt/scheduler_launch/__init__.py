"""The launcher cores that start scheduler ranks under their placements.

``mp`` starts ranks as spawned processes (``spawn_hook`` puts numactl in front
of them); ``ray_launcher`` starts them as Ray actors, planning on each node
through ``ray_sites``; ``ray_actors`` is what sglang's own ``RayEngine``
delegates to; ``verify_runners`` hands both to ``verify``. What runs inside a
rank is in ``sglang.srt.scheduler_rank``. Nothing is imported here, so that
importing the package imports neither Ray nor torch.
"""
