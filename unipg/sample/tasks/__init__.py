"""Text tasks: a registry of train/test splits of examples (``base``), and the built-in tasks, each in its own
module, registered on import."""

# register the tasks defined in their own modules
from unipg.sample.tasks import calculator, dataset, gsm8k, multihop, procedural, solver_checker, units  # noqa: F401
