"""Who runs what, when: the driver (``driver.Runtime``; synchronous training is staleness 0), the replay buffer
and staleness gate (``replay``), the gym and lm training loops (``gym``, ``lm``), run setup, stopping and
rollback, evaluation, and the backends that place an lm run's episodes (``backends``)."""


def __getattr__(name: str):
    """``BACKENDS``, ``BACKEND_INPUTS``, the ``Rollout`` protocol and its ``RolloutReport``, imported on first use (the
    backends import the whole runtime)."""
    if name in ("BACKENDS", "BACKEND_INPUTS"):
        from unipg.runtime import backends

        return getattr(backends, name)
    if name in ("Rollout", "RolloutReport"):
        from unipg.runtime import driver

        return getattr(driver, name)
    raise AttributeError(f"module 'unipg.runtime' has no attribute {name!r}")


__all__ = ["BACKENDS", "BACKEND_INPUTS", "Rollout", "RolloutReport"]
