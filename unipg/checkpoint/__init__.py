"""What survives a crash: crash-safe checkpoints (``files``: safetensors + JSON with a manifest, verified on
load), the store that keeps the last and best (``store``), and the lm run's checkpointer for resume and
rollback (``lm``)."""
