"""The agent rollout loop: generate → parse → environment step → append the observation → generate …

An episode's tokens after its prompt interleave what the policy sampled with what the environment
inserted (the closing of the assistant turn, the observation message, the opening of the next assistant
turn). ``loss_mask`` is 1 exactly on sampled tokens, so tool output never enters the loss, and the policy's
tokens are kept as sampled (never re-tokenized), so their behaviour log-probs stay exact.

An episode ends when the environment says done, after ``max_turns`` policy turns, or when its token budget
``max_total_tokens`` (sampled + inserted tokens after the prompt) is spent; an episode cut short gets no
final reward. Many episodes run concurrently; their generation requests meet in the ``HFService``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from unipg.envs.base import Env, TurnInfo
from unipg.inference import HFService
from unipg.inference.base import TurnOutput
from unipg.policy.chat import TurnTemplate
from unipg.tasks.base import Example

T = TypeVar("T")


@dataclass
class Trajectory:
    """One episode, token by token after the prompt, with its per-turn rewards and facts."""

    example: Example
    prompt_ids: list[int]  # the rendered first observation (system prompt, tools, user message)
    token_ids: list[int] = field(default_factory=list)  # every token after the prompt, sampled or inserted
    loss_mask: list[int] = field(default_factory=list)  # 1 on tokens the policy sampled, 0 on inserted ones
    behaviour_logprobs: list[float] = field(default_factory=list)  # log μ on sampled tokens, 0 elsewhere
    turn_of_token: list[int] = field(default_factory=list)  # policy turn a sampled token belongs to; -1 inserted
    step_rewards: list[float] = field(default_factory=list)  # reward of each policy turn (final one included)
    policy_versions: list[int] = field(default_factory=list)  # weights version that sampled each turn
    # (token index, version): from that sampled token to the end of its turn a newer version sampled (a weight
    # load interrupted the turn, ``runtime.partial_rollouts``); empty when every turn had one version
    version_changes: list[tuple[int, int]] = field(default_factory=list)
    turn_texts: list[str] = field(default_factory=list)
    infos: list[TurnInfo] = field(default_factory=list)  # what the environment reported of each turn
    finish: str = "running"  # "done", "max_turns", "max_tokens"
    cut: bool = False  # its last turn stopped at its token budget (finish reason "length"), graded or not
    messages: list[dict] = field(default_factory=list)  # what the policy was told: the first observation, then
    # each observation inserted after a turn, as chat messages {"role", "content"} (turn texts are turn_texts)
    role: str | None = None  # the role this trajectory plays in a multi-role episode; None: a one-role episode
    offline: bool = False  # read from recorded episodes (``data.offline``), not sampled by this run
    side: list[Trajectory] = field(default_factory=list)  # the episode's other trajectories (an external agent
    # that rewrote its history): each a training row of its own beside this one, sharing its group advantage

    @property
    def rows(self) -> list[Trajectory]:
        """The episode's training rows: this trajectory, then its side ones."""
        return [self, *self.side]

    @property
    def turns(self) -> int:
        return len(self.turn_texts)

    @property
    def reward(self) -> float:
        """The episode return: the sum of the step rewards."""
        return sum(self.step_rewards)

    @property
    def correct(self) -> bool:
        """The task was completed: the final answer equals the reference answer."""
        return bool(self.infos and self.infos[-1].correct)

    @property
    def tool_calls(self) -> int:
        return sum(1 for info in self.infos if info.tool_status is not None)

    def tool_status_count(self, status: str) -> int:
        return sum(1 for info in self.infos if info.tool_status == status)

    def add_sampled(self, token_ids: list[int], logprobs: list[float], turn: int) -> None:
        self.token_ids += token_ids
        self.loss_mask += [1] * len(token_ids)
        self.behaviour_logprobs += logprobs
        self.turn_of_token += [turn] * len(token_ids)

    def add_turn(self, out: TurnOutput) -> None:
        """A policy turn: its sampled tokens, its text and the weights version(s) that sampled it."""
        start = len(self.token_ids)
        self.add_sampled(out.token_ids, out.behaviour_logprobs, self.turns)
        self.turn_texts.append(out.text)
        self.policy_versions.append(out.policy_version)
        self.version_changes += [(start + offset, version) for offset, version in out.version_changes]

    def add_inserted(self, token_ids: list[int]) -> None:
        self.token_ids += token_ids
        self.loss_mask += [0] * len(token_ids)
        self.behaviour_logprobs += [0.0] * len(token_ids)
        self.turn_of_token += [-1] * len(token_ids)


@dataclass
class AgentLoop:
    """How episodes are run: the engine that samples, the template and tokenizer that lay out turns."""

    engine: HFService
    template: TurnTemplate
    encode_prompt: Callable[[str], list[int]]  # first observation → prompt token ids (rendered, truncated)
    max_turns: int
    max_new_tokens: int  # per policy turn
    max_total_tokens: int  # per episode, after the prompt
    context_length: int | None = None  # the model's: prompt and episode together never pass it (None: no limit)

    def room(self, trajectory: Trajectory) -> int:
        """Tokens the episode may still add: ``max_total_tokens`` after the prompt, within the model's context."""
        room = self.max_total_tokens - len(trajectory.token_ids)
        if self.context_length is not None:
            room = min(room, self.context_length - len(trajectory.prompt_ids) - len(trajectory.token_ids))
        return room

    def tokenize(self, text: str) -> list[int]:
        return self.template.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    @contextlib.asynccontextmanager
    async def running(self):
        """What episodes need running around them: the engine's batching worker."""
        async with self.engine.running():
            yield self

    async def run_episode(self, env: Env, example: Example, order: int) -> Trajectory:
        first = await env.reset(example)
        trajectory = Trajectory(example, self.encode_prompt(first), messages=[{"role": "user", "content": first}])
        async with self.engine.episode():
            for turn in range(self.max_turns):
                budget = min(self.max_new_tokens, self.room(trajectory))
                if budget <= 0:
                    trajectory.finish = "max_tokens"
                    break
                out = await self.engine.generate(
                    trajectory.prompt_ids + trajectory.token_ids, max_new_tokens=budget, order=order
                )
                trajectory.add_turn(out)
                trajectory.cut = out.finish_reason == "length"
                observation, reward, done, info = await env.step(out.text)
                trajectory.step_rewards.append(float(reward))
                trajectory.infos.append(TurnInfo.of(info))
                if done:
                    trajectory.finish = "done"
                    break
                if turn == self.max_turns - 1:
                    trajectory.finish = "max_turns"
                    break
                inserted = self.tokenize(
                    self.template.closing(out.ended_with_eos)
                    + self.template.observation(observation, env.observation_role)
                )
                if len(inserted) >= self.room(trajectory):
                    trajectory.finish = "max_tokens"  # no room left to answer after this observation
                    break
                trajectory.add_inserted(inserted)
                trajectory.messages.append({"role": env.observation_role, "content": observation})
        return trajectory

    async def run_episodes(
        self, envs: list[Env], examples: list[Example], *, concurrency: int | None = None
    ) -> list[Trajectory]:
        """Run one episode per (env, example) concurrently; results in input order."""
        async with self.running():
            return await run_concurrently(
                lambda i: self.run_episode(envs[i], examples[i], order=i), len(examples), concurrency
            )


async def run_concurrently(run_one: Callable[[int], Awaitable[T]], count: int, concurrency: int | None) -> list[T]:
    """``run_one(0) ... run_one(count - 1)`` with at most ``concurrency`` (None: all) at once; results in order."""
    limit = asyncio.Semaphore(concurrency or count)

    async def bounded(index: int) -> T:
        async with limit:
            return await run_one(index)

    return list(await asyncio.gather(*(bounded(i) for i in range(count))))
