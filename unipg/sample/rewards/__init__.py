"""Rewards for text completions: rule-based rewards and their combination (``rules``), and a learned reward
model (``model``), registered on import."""

from unipg.sample.rewards import model  # noqa: F401  (registers the learned 'reward_model' reward)
