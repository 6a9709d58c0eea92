"""The multi-turn text environment protocol and its registry.

An episode is ``observation = await env.reset(example)`` followed by turns of
``observation, reward, done, info = await env.step(action_text)``: the policy writes ``action_text``, the
environment answers with the next observation (a tool's output, an error message, a game state) and a
reward for that step. Both methods are coroutines so that many episodes can wait on slow tools at once.

``ENVS`` maps a name to a factory ``(task, reward_fn, service, **options) -> Env``, whose other keyword
parameters are the options it declares; a fresh environment is built per episode, so environments may keep
per-episode state. ``observation_role`` is the chat role the
observations are rendered with (``tool`` for tool outputs, ``user`` for a game or a simulated user).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

from unipg.registry import FactoryRegistry
from unipg.tasks.base import Example

# Every factory takes the task, the reward function and the environment service; its other keyword
# parameters are its options.
ENVS = FactoryRegistry("environment", inputs=("task", "reward_fn", "service"))


class StepResult(NamedTuple):
    observation: str  # text the policy sees next ("" when done)
    reward: float  # reward of this step: process rewards, failure penalties, and the final reward when done
    done: bool  # the episode is over
    info: dict  # per-step facts for metrics: tool name and status, whether the final answer was correct, ...


@runtime_checkable
class Env(Protocol):
    observation_role: str

    async def reset(self, example: Example) -> str:
        """Start an episode on ``example``; returns the first observation (the user prompt)."""
        ...

    async def step(self, action: str) -> StepResult:
        """Apply the policy's turn ``action``; returns (observation, reward, done, info)."""
        ...


@runtime_checkable
class RoleEnv(Protocol):
    """An episode in which several roles take turns (``unipg.sample.roles``).

    ``step``'s info says who acts next (``next_role``; absent: the same role) and as what the observation
    reaches it (``observation_role``: ``user``, the default, or ``tool``); the first observation a role
    receives is its prompt. When done, info holds ``role_rewards`` ({role: team reward + its shaping}, added to
    each role's last turn) and ``correct`` (the team's outcome)."""

    roles: tuple[str, ...]  # every role of an episode, in the order their trajectories are returned

    async def reset(self, example: Example) -> tuple[str, str]:
        """Start an episode on ``example``; returns (the role that acts first, its first observation)."""
        ...

    async def step(self, action: str) -> StepResult:
        """Apply the acting role's turn ``action``."""
        ...


async def final_answer_reward(reward_fn, example: Example, completion: str) -> tuple[float, dict]:
    """The reward of a final answer under the task's reward functions, and the info facts about it: whether
    the extracted final answer equals the example's reference answer (the task-completion criterion of
    evaluation) and each reward function's value."""
    from unipg.tasks.answers import extract_final_answer
    from unipg.tasks.rewards.rules import answers_equivalent

    columns = {name: [value] for name, value in example.columns.items()}
    scored = await reward_fn.acall([example.prompt], [completion], **columns)
    predicted = extract_final_answer(completion)
    correct = predicted is not None and answers_equivalent(predicted, example.answer)
    reward = float(scored.total[0])
    terms = {name: values[0] for name, values in scored.per_function.items() if values[0] is not None}
    return reward, {"final": True, "correct": correct, "final_reward": reward, "reward_terms": terms}
