"""The launcher cores that start scheduler ranks under their placements.

``common`` holds what both launchers share; ``mp`` starts ranks as spawned
processes (``spawn_hook`` puts numactl in front of them, ``child`` is their
entry); ``ray_launcher`` and ``ray_node`` start them as Ray actors. Nothing is
imported here, so that importing the package imports neither Ray nor torch.
"""
