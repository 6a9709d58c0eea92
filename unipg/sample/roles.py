"""Multi-role episodes: several roles (a solver and a checker, say) take turns in one episode.

Each role is a policy: the run's one model, told apart by its role's system prompt (``agent.role_policy: shared``),
or with ``agent.role_policy: adapters`` that model under the role's own LoRA adapter (the engine samples a role's
turns with its adapter active; each role's rows train its adapter only, ``unipg.learn.role_adapters``), or with
``agent.role_policy: separate`` a model of its own (``unipg.learn.role_learners``). The
environment (a ``RoleEnv``) says who acts next. Each role keeps its own conversation: its first observation is its prompt, rendered with its system prompt; what another role
said reaches it as a ``user`` message, a tool's output as a ``tool`` message. So each role's side of the
episode is an ordinary ``Trajectory`` — its sampled tokens with their behaviour log-probs and versions, the
inserted ones masked out — tagged with its role, and the learner trains one row per role per episode.

Rewards: a step's reward is the acting role's own (process rewards of its tool calls); when the episode ends
the environment's ``role_rewards`` (the team reward plus each role's shaping) are added to each role's last
turn, and every role's last info carries the team outcome (``correct``). A role that never acted gets an
empty trajectory (no sampled token, no gradient) so that every episode gives one row per role.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from unipg.envs.base import RoleEnv, TurnInfo
from unipg.inference import HFService
from unipg.policy.chat import TurnTemplate
from unipg.sample.agent import AgentLoop, Trajectory, run_concurrently
from unipg.tasks.base import Example


@dataclass
class RoleLoop:
    """How multi-role episodes are run: one engine for every role, one prompt encoder per role."""

    engine: HFService
    template: TurnTemplate
    encoders: dict[str, Callable[[str], list[int]]]  # role → first observation → prompt token ids
    max_turns: int  # per role
    max_new_tokens: int  # per policy turn
    max_total_tokens: int  # per role's trajectory, after its prompt
    context_length: int | None = None
    role_adapters: bool = False  # requests name their role: its own adapter or model samples its turns
    # (``agent.role_policy: adapters`` or ``separate``)

    def __post_init__(self):
        self.budget = AgentLoop(
            self.engine,
            self.template,
            lambda text: [],
            max_turns=self.max_turns,
            max_new_tokens=self.max_new_tokens,
            max_total_tokens=self.max_total_tokens,
            context_length=self.context_length,
        )  # its room and tokenize, per trajectory

    @contextlib.asynccontextmanager
    async def running(self):
        """What episodes need running around them (the concurrent schedule's rollout too): the engine's batching
        worker."""
        async with self.engine.running():
            yield self

    def _start(self, example: Example, role: str, observation: str) -> Trajectory:
        return Trajectory(
            example, self.encoders[role](observation), role=role, messages=[{"role": "user", "content": observation}]
        )

    async def run_episode(self, env: RoleEnv, example: Example, order: int) -> list[Trajectory]:
        """One episode; its trajectories in ``env.roles`` order."""
        role, first = await env.reset(example)
        trajectories = {role: self._start(example, role, first)}
        closing: dict[str, str] = {}  # the rest of each role's last turn, inserted before what it sees next
        finish, outcome = "max_turns", TurnInfo()
        async with self.engine.episode():
            while True:
                mine = trajectories[role]
                budget = min(self.max_new_tokens, self.budget.room(mine))
                if budget <= 0 or mine.turns >= self.max_turns:
                    finish = "max_tokens" if budget <= 0 else "max_turns"
                    break
                adapter = {"role": role} if self.role_adapters else {}  # engines without adapters take no role
                out = await self.engine.generate(
                    mine.prompt_ids + mine.token_ids, max_new_tokens=budget, order=order, **adapter
                )
                mine.add_turn(out)
                observation, reward, done, info = await env.step(out.text)
                info = TurnInfo.of(info)
                mine.step_rewards.append(float(reward))
                mine.infos.append(info)
                closing[role] = self.template.closing(out.ended_with_eos)
                if done:
                    finish, outcome = "done", info
                    break
                role = info.next_role if info.next_role is not None else role
                if role not in trajectories:
                    trajectories[role] = self._start(example, role, observation)
                    continue
                kind = info.observation_role or "user"
                inserted = self.budget.tokenize(closing.pop(role, "") + self.template.observation(observation, kind))
                if len(inserted) >= self.budget.room(trajectories[role]):
                    finish = "max_tokens"
                    break
                trajectories[role].add_inserted(inserted)
                trajectories[role].messages.append({"role": kind, "content": observation})
        return [
            self._settle(trajectories.get(name) or self._start(example, name, example.prompt), finish, outcome)
            for name in env.roles
        ]

    @staticmethod
    def _settle(trajectory: Trajectory, finish: str, outcome: TurnInfo) -> Trajectory:
        """Give ``trajectory`` the episode's end: its finish, its role's reward on its last turn, the outcome."""
        trajectory.finish = finish
        if trajectory.turns:
            trajectory.step_rewards[-1] += float(outcome.role_rewards.get(trajectory.role, 0.0))
            trajectory.infos[-1] = dataclasses.replace(trajectory.infos[-1], correct=bool(outcome.correct))
        return trajectory

    async def run_episodes(
        self, envs: list[RoleEnv], examples: list[Example], *, concurrency: int | None = None
    ) -> list[list[Trajectory]]:
        """One episode per (env, example) concurrently; each episode's trajectories, in input order."""
        async with self.running():
            return await run_concurrently(
                lambda i: self.run_episode(envs[i], examples[i], order=i), len(examples), concurrency
            )


def role_major(episodes: list[list[Trajectory]]) -> list[Trajectory]:
    """The trajectories of a group's episodes, role after role: the group's samples of one (prompt, role) are
    consecutive (group advantages compare the samples of one role, ``unipg.runtime.lm.group_index``)."""
    roles = len(episodes[0]) if episodes else 0
    return [episode[index] for index in range(roles) for episode in episodes]
