"""Gymnasium environments on the text protocol: observations become text, the policy's text becomes an action.

This keeps classic control tasks on the same ``reset``/``step`` protocol as tool-using agents, so a language
model can play CartPole turn by turn through the agent loop. Observations are rendered as numbers rounded
to ``decimals``; a discrete action is read as the first integer in the policy's turn, and a turn without a
valid action ends the episode with ``invalid_action_penalty``. (MLP policies keep the vectorised
``gym_rollout`` path, which is what they need for speed.)
"""

from __future__ import annotations

import re

import numpy as np

from unipg.envs.base import ENVS, StepResult, TurnInfo
from unipg.tasks.base import Example

_INTEGER = re.compile(r"-?\d+")


class GymTextEnv:
    """A gymnasium environment with a discrete action space, spoken to in text."""

    observation_role = "user"

    def __init__(
        self,
        env_id: str,
        *,
        decimals: int = 2,
        invalid_action_penalty: float = -1.0,
        max_episode_steps: int | None = None,
    ):
        import gymnasium as gym

        self.env = gym.make(env_id, max_episode_steps=max_episode_steps)
        if not isinstance(self.env.action_space, gym.spaces.Discrete):
            raise ValueError(
                f"'{env_id}' has a {type(self.env.action_space).__name__} action space; the text "
                "adapter needs a Discrete one (the policy names an action by its number)"
            )
        self.decimals, self.invalid_action_penalty = decimals, invalid_action_penalty

    def render_observation(self, observation) -> str:
        values = np.asarray(observation, dtype=float).ravel()
        return (
            "observation: "
            + " ".join(f"{value:.{self.decimals}f}" for value in values)
            + f"; action (0-{self.env.action_space.n - 1})?"
        )

    async def reset(self, example: Example) -> str:
        seed = example.columns.get("seed") if example is not None else None
        observation, _ = self.env.reset(seed=seed)
        return self.render_observation(observation)

    async def step(self, action: str) -> StepResult:
        match = _INTEGER.search(action)
        # An action is a small index: a run of digits longer than the largest index is invalid, and is not
        # converted (a policy-written run past Python's int-string limit would raise).
        if (
            match is None
            or len(match.group().lstrip("-").lstrip("0")) > len(str(self.env.action_space.n))
            or not 0 <= int(match.group()) < self.env.action_space.n
        ):
            return StepResult(
                "",
                self.invalid_action_penalty,
                True,
                TurnInfo(final=True, correct=False, extras={"invalid_action": True}),
            )
        observation, reward, terminated, truncated, _ = self.env.step(int(match.group()))
        done = bool(terminated or truncated)
        info = TurnInfo(final=True, correct=bool(truncated and not terminated)) if done else TurnInfo()
        return StepResult("" if done else self.render_observation(observation), float(reward), done, info)


@ENVS.register("gym")
def gym_env(task, reward_fn=None, service=None, *, env_id: str = "CartPole-v1", **options) -> GymTextEnv:
    return GymTextEnv(env_id, **options)
