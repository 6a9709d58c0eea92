"""The reward window the doctor's reward checks read: the run's reward metric over the recent steps, its scale, and
the best reward the task allows where that is known (a gymnasium environment's threshold, the configured rule
rewards' weights, or 1 for a reward that stays in [0, 1]), so a reward flat at its ceiling is not called flat."""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass

from unipg.observe.findings import History
from unipg.observe.trends import MIN_TREND_POINTS, fitted_rise

REWARD_METRICS = ("rollout/episode_return", "rollout/reward_mean")
# A reward within 5% of the scale below its known ceiling has nothing left to learn; flat is then fine.
SATURATION_MARGIN = 0.05


@dataclass(frozen=True)
class RewardWindow:
    name: str
    steps: list[int]
    values: list[float]
    scale: float
    ceiling: float | None
    saturated: bool
    rise: float
    """how far the least-squares trend line moves across the window"""


@functools.lru_cache(maxsize=32)
def gym_reward_threshold(env_id: str) -> float | None:
    try:
        import gymnasium

        return gymnasium.spec(env_id).reward_threshold
    except Exception:  # an unknown or unregistered id only means the ceiling is unknown
        return None


# Rewards that score a completion in [0, 1] (a correct answer scores 1), and the one that only ever subtracts:
# a weighted sum of them tops out at the sum of the positive weights.
UNIT_INTERVAL_REWARDS = frozenset({"exact_match", "math", "digits", "format", "reasoning_gym"})
NON_POSITIVE_REWARDS = frozenset({"length"})


def configured_reward_ceiling(history: History) -> float | None:
    """The most the configured ``task.rewards`` can add up to, when each of them is bounded; else None."""
    rewards = history.setting("task.rewards")
    if not isinstance(rewards, list) or not rewards:
        return None
    total = 0.0
    for reward in rewards:
        name = reward.get("name") if isinstance(reward, dict) else None
        weight = reward.get("weight", 1.0) if isinstance(reward, dict) else None
        if name in NON_POSITIVE_REWARDS:
            continue
        if name not in UNIT_INTERVAL_REWARDS or not isinstance(weight, (int, float)):
            return None
        total += max(float(weight), 0.0)
    return total


def reward_ceiling(name: str, values: list[float], history: History) -> float | None:
    """The best reward the task allows, where it is known."""
    if name == "rollout/episode_return":
        env_id = history.setting("env.id")
        return gym_reward_threshold(env_id) if isinstance(env_id, str) else None
    configured = configured_reward_ceiling(history)
    if configured is not None and max(values) <= configured:
        return configured  # e.g. 1.5 for math beside digits at weight 0.5
    if min(values) >= 0.0 and max(values) <= 1.0:  # rule-based rewards (correct = 1) score in [0, 1]
        return 1.0
    return None


def reward_window(history: History) -> RewardWindow | None:
    name = next((name for name in REWARD_METRICS if history.finite(name)[1]), None)
    if name is None:
        return None
    steps, values = history.finite(name)
    if len(values) < MIN_TREND_POINTS:
        return None
    ceiling = reward_ceiling(name, values, history)
    scale = max(abs(ceiling) if ceiling is not None else 0.0, max(abs(v) for v in values)) or 1.0
    recent_steps, recent = steps[-history.window :], values[-history.window :]
    if ceiling is not None:
        saturated = statistics.fmean(recent) >= ceiling - SATURATION_MARGIN * scale
    else:  # exactly constant at the run's best after having been lower: a deterministic ceiling was reached
        saturated = min(recent) == max(recent) == max(values) > min(values)
    return RewardWindow(name, recent_steps, recent, scale, ceiling, saturated, fitted_rise(recent))
