"""Placement for sglang's launchers: ``spawn``, ``ray_rank``. Empty: imports no Ray."""
