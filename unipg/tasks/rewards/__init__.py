"""Rewards for text completions: rule-based rewards and their combination (``rules``, ``combine``), and a learned
reward model (``model``) and the generators' own scores of the ``reasoning_gym`` task (``procedural``), registered
on import."""

from unipg.tasks.rewards import model, procedural  # noqa: F401  (register 'reward_model' and 'reasoning_gym')
from unipg.tasks.rewards.combine import CombinedReward, RewardFunction, RewardFunctionError
from unipg.tasks.rewards.rules import REWARDS, build_rewards, text_of

__all__ = ["REWARDS", "CombinedReward", "RewardFunction", "RewardFunctionError", "build_rewards", "text_of"]
