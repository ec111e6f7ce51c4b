"""The glue sglang's own launchers call to start scheduler ranks under their placement.

``spawn`` is what ``numa_utils.configure_subprocess`` does around each spawned
scheduler (with ``spawn_hook``, the numactl prefix on the child's command line);
``ray_rank`` is the bind each Ray ``SchedulerActor`` runs on itself before its
``Scheduler`` exists. Nothing is imported here, so that importing the package
imports neither Ray nor torch.
"""
