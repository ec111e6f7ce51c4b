"""The launcher cores that start scheduler ranks under their placements.

``common`` holds what both launchers share; ``mp`` starts ranks as spawned
processes (``spawn_hook`` puts numactl in front of them, ``child`` is their
entry); ``ray_launcher`` starts them as Ray actors, through ``ray_sites`` (the
driver's rounds), ``ray_node`` (what runs on a node) and ``ray_plan`` (the
values passed between them). Nothing is imported here, so that importing the
package imports neither Ray nor torch.
"""
