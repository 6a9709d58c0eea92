"""The multi-turn text environment protocol and its registry.

An episode is ``observation = await env.reset(example)`` followed by turns of
``observation, reward, done, info = await env.step(action_text)``: the policy writes ``action_text``, the
environment answers with the next observation (a tool's output, an error message, a game state) and a
reward for that step. Both methods are coroutines so that many episodes can wait on slow tools at once.

``ENVS`` maps a name to a factory ``(task, reward_fn, service, **options) -> Env``, whose other keyword
parameters are the options it declares; a fresh environment is built per episode, so environments may keep
per-episode state. ``observation_role`` is the chat role the
observations are rendered with (``tool`` for tool outputs, ``user`` for a game or a simulated user).

A step's ``info`` is a ``TurnInfo``: the facts about the turn that metrics, transcripts and multi-role episodes
read (a final answer and whether it was correct, a tool call and its status, who acts next). An environment
written against the earlier protocol may still return a plain dict with those names as keys; the agent loop
converts it (``TurnInfo.of``), keeping unknown keys in ``extras``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple, Protocol, runtime_checkable

from unipg.registry import FactoryRegistry
from unipg.tasks.base import Example

# Every factory takes the task, the reward function and the environment service; its other keyword
# parameters are its options.
ENVS = FactoryRegistry("environment", inputs=("task", "reward_fn", "service"))


@dataclass(frozen=True)
class TurnInfo:
    """What an environment reports about one policy turn, besides its observation and reward (``StepResult``).

    Every field has a neutral default, so a step sets only what happened: ``TurnInfo(final=True, correct=True)``
    for a right final answer, ``TurnInfo(tool="calculator", tool_status="ok", observation="42")`` for a call.
    Frozen: what an environment reported is not edited afterwards (``dataclasses.replace`` makes a changed copy).
    """

    # a final answer, scored by the task's reward functions
    final: bool = False  # the turn was the episode's final answer
    correct: bool = False  # the final answer equals the reference answer (the task-completion criterion)
    final_reward: float | None = None  # the final answer's reward (an external agent's own, when it reports one)
    reward_terms: dict[str, float] | None = None  # each reward function's value, of those that applied (None: unscored)
    reward_none: list[str] = field(default_factory=list)  # the reward functions that returned None for the answer
    # a tool call (or an attempt at one)
    tool: str | None = None  # the tool called (None: a malformed call that names no known tool)
    tool_status: str | None = None  # ok, error, malformed, failed, ... (None: the turn called no tool)
    arguments: dict | None = None  # the call's arguments (a well-formed call only)
    attempts: int = 0  # runs of the call by the environment service, retries included
    timeouts: int = 0  # of those, the runs stopped at the service's timeout
    tool_seconds: float = 0.0  # seconds the call took, retries included
    process_reward: float = 0.0  # the process reward (negative: penalty) the call earned
    observation: str | None = None  # what the policy was shown of the call: the tool's output or the error
    # multi-role episodes (``RoleEnv``)
    next_role: str | None = None  # the role that acts next (None: the same role)
    observation_role: str | None = None  # the chat role the observation reaches it as (None: user)
    role_rewards: dict[str, float] = field(default_factory=dict)  # when done: each role's reward (on its last turn)
    # an external agent (``task.agent``)
    agent_error: str | None = None  # why the episode failed on every attempt (None: it did not fail)
    extras: dict[str, Any] = field(default_factory=dict)  # anything else an environment reports (its own facts)

    @classmethod
    def of(cls, info: TurnInfo | Mapping[str, Any] | None) -> TurnInfo:
        """``info`` as a ``TurnInfo``: itself; None as the empty one; a dict of an environment written against the
        earlier protocol, its known keys (the field names) as fields and the others in ``extras``."""
        if isinstance(info, TurnInfo):
            return info
        if info is None:
            return cls()
        if not isinstance(info, Mapping):
            raise TypeError(
                f"an environment's step returned info of type {type(info).__name__}; return a "
                "unipg.envs.TurnInfo (or a dict with its field names as keys) as StepResult's info"
            )
        known = {name.name for name in fields(cls)} - {"extras"}
        facts = {key: value for key, value in info.items() if key in known}
        for name in ("reward_terms", "role_rewards"):
            if facts.get(name) is not None and not isinstance(facts[name], Mapping):
                raise TypeError(
                    f"an environment's step info has {name} of type {type(facts[name]).__name__}; "
                    f"it must map names to numbers, e.g. {{'math': 1.0}}"
                )
        extras = {
            **info.get("extras", {}),
            **{key: value for key, value in info.items() if key not in known and key != "extras"},
        }
        return cls(**facts, extras=extras)


class StepResult(NamedTuple):
    observation: str  # text the policy sees next ("" when done)
    reward: float  # reward of this step: process rewards, failure penalties, and the final reward when done
    done: bool  # the episode is over
    info: TurnInfo = TurnInfo()  # the facts about the turn (a dict with TurnInfo's field names is accepted too)


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

    ``step``'s info says who acts next (``TurnInfo.next_role``; None: the same role) and as what the observation
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


async def final_answer_reward(reward_fn, example: Example, completion: str) -> tuple[float, TurnInfo]:
    """The reward of a final answer under the task's reward functions, and the facts about it: whether the
    extracted final answer equals the example's reference answer (the task-completion criterion of evaluation),
    each reward function's value, and the functions that returned None for it (not applicable)."""
    from unipg.tasks.answers import extract_final_answer
    from unipg.tasks.rewards.rules import answers_equivalent_async

    columns = {name: [value] for name, value in example.columns.items()}
    scored = await reward_fn.acall([example.prompt], [completion], **columns)
    predicted = extract_final_answer(completion)
    correct = predicted is not None and await answers_equivalent_async(predicted, example.answer)
    reward = float(scored.total[0])
    terms = {name: values[0] for name, values in scored.per_function.items() if values[0] is not None}
    unscored = [name for name in scored.per_function if name not in terms]
    return reward, TurnInfo(final=True, correct=correct, final_reward=reward, reward_terms=terms, reward_none=unscored)
