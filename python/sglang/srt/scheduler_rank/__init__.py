"""A scheduler rank's own side of a launch, below both launchers and the Ray actor.

``common`` holds what every launcher and rank share (the report types, the
exec decision, the readiness check, the read-back of a binding); ``child`` is
a spawned rank's entry and the in-rank part of its placement; ``ray_plan``
holds the typed values that pass between a Ray driver, its nodes and its
actors, and ``ray_node`` the tasks that run on a node. Nothing here imports a
launcher, and importing the package imports neither Ray nor torch.
"""
