"""Single-turn tasks as the one-step case of the environment protocol: the first answer ends the episode."""

from __future__ import annotations

from unipg.envs.base import ENVS, StepResult, final_answer_reward
from unipg.tasks.base import Example


class SingleTurnEnv:
    """The prompt is the observation; the completion is scored by the task's rewards and ends the episode."""

    observation_role = "user"

    def __init__(self, reward_fn):
        self.reward_fn = reward_fn
        self.example: Example | None = None

    async def reset(self, example: Example) -> str:
        self.example = example
        return example.prompt

    async def step(self, action: str) -> StepResult:
        if self.example is None:
            raise RuntimeError("call reset() before step()")
        reward, info = await final_answer_reward(self.reward_fn, self.example, action)
        return StepResult("", reward, True, info)


@ENVS.register("single_turn")
def single_turn_env(task, reward_fn, service=None, **options) -> SingleTurnEnv:
    return SingleTurnEnv(reward_fn)
