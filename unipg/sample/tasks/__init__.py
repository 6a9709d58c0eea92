"""Text tasks: a registry of train/test splits of examples (``base``), and the built-in tasks, each in its own
module, registered on import."""

from unipg.sample.tasks import calculator, gsm8k, multihop, solver_checker, units  # noqa: F401  (register the tasks defined in their own modules)
