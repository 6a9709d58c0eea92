"""Who runs what, when: the driver (``driver.Runtime``; synchronous training is staleness 0), the replay buffer
and staleness gate (``replay``), the gym and lm training loops (``gym``, ``lm``), run setup, stopping and
rollback, evaluation, and the backends that place an lm run's episodes (``backends``)."""
