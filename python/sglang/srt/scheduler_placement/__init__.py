"""The glue sglang's own launchers call to start scheduler ranks under their placement.

``spawn`` is what ``numa_utils.configure_subprocess`` does around each spawned
scheduler (with ``spawn_hook``, the numactl prefix on the child's command line);
``ray_actors`` is what ``RayEngine._create_scheduler_actor`` delegates to, with
the planning round on the nodes (``ray_round``, ``ray_node``, the values in
``ray_plan``); ``in_rank`` applies and reads back a placement inside a rank.
Nothing is imported here, so that importing the package imports neither Ray
nor torch.
"""
