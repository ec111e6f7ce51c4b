"""The glue sglang's own launchers call to start scheduler ranks under their placement.

``spawn`` is what ``numa_utils.configure_subprocess`` does around each spawned
scheduler (with ``spawn_hook``, the numactl prefix on the child's command line);
``ray_actors`` is what ``RayEngine._create_scheduler_actor`` delegates to, with
the planning round's values, decisions and node tasks in ``ray_plan``;
``ray_rank`` is the actor's body (it applies and reads back its placement).
Nothing is imported here, so that importing the package imports neither Ray
nor torch.
"""
