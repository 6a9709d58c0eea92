"""Rewards for text completions: rule-based rewards and their combination (``rules``), and a learned reward
model (``model``) and the generators' own scores of the ``reasoning_gym`` task (``procedural``), registered on
import."""

from unipg.sample.rewards import model, procedural  # noqa: F401  (register 'reward_model' and 'reasoning_gym')
