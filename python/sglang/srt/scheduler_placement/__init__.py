"""What sglang's launchers call to start scheduler ranks under their placement:
``spawn`` (``configure_subprocess``) and ``ray_rank`` (a Ray actor's self-bind).
Empty, so that importing the package imports neither Ray nor torch."""
