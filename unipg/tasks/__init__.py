"""What is asked and how it is graded: text tasks (train/test splits of examples, ``TASKS``), the built-in tasks,
each in its own module and registered on import, rewards (``REWARDS``) and answer grading.

Plugins import from here: ``from unipg.tasks import TASKS, REWARDS, Example, Task``.
"""

from unipg.tasks import calculator, dataset, gsm8k, multihop, procedural, solver_checker, units  # noqa: F401  (register)
from unipg.tasks.base import TASKS, Example, Task, make_task
from unipg.tasks.rewards import REWARDS, CombinedReward, RewardFunction, RewardFunctionError, build_rewards, text_of

__all__ = [
    "REWARDS",
    "TASKS",
    "CombinedReward",
    "Example",
    "RewardFunction",
    "RewardFunctionError",
    "Task",
    "build_rewards",
    "make_task",
    "text_of",
]
