"""External agents as environments: your own agent plays the episodes, through the endpoint.

``task.agent`` names ``async def run(base_url: str, api_key: str, example) -> float | str | dict``. Each
episode opens a session of the endpoint and calls ``run`` with the endpoint's base URL and the session's key;
the agent talks to the policy with any OpenAI client. The base URL is the same for every episode of the run
(each batch of episodes serves the endpoint again, on the port the first one bound), so an agent may keep one
client and only change its key per episode. What ``run`` returns decides the reward:

- a number: the reward itself;
- a string: the final answer, scored with the task's reward functions;
- a dict with ``reward`` (a number) and/or ``answer`` (a string), as above;
- anything else is garbage: the episode failed.

Whatever it returns, the final answer (``answer``, else the model's last reply) is checked against the
reference answer for the completion rate. As the environment service does for tools, each attempt runs
under ``endpoint.agent_timeout`` seconds, a failed attempt (raised, timed out, garbage, no model call) is
retried ``endpoint.agent_retries`` times in a fresh session, and an episode that failed on every attempt
counts as failed: it trains nothing (no sampled tokens), is counted in the rollout metrics, and never stops
the run. The episode's trajectory is the one holding its last call; calls that continued no earlier
trajectory (an agent that rewrote or summarised its history, or the other choices of a call with ``n`` > 1)
form other trajectories of the episode. Each is trained too (``Trajectory.side``), with the episode's reward
on its last call, and shares the episode's group advantage (``unipg.learn.lm_batch``); they are counted in
``agent_extra_trajectories``.

The tool messages an agent sends back after a reply that called tools are that turn's observations, recorded as
the built-in agent loop records a call (``TurnInfo``: the tool, its arguments, its status and the result), so the
tool metrics (``tool_calls``, ``tool_success_rate``) and the transcripts count them alike. A result counts as an
error (status ``error``) when its text starts as a tool error does in unipg (``error: ...``) or in the usual agent
frameworks (``Error: ...``, ``An error occurred while running the tool ...``); anything else is ``ok``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from unipg.config import ConfigError
from unipg.config.plugins import import_plugin
from unipg.envs.base import TurnInfo, final_answer_reward
from unipg.inference import HFService
from unipg.inference.endpoint.protocol import Completions, Limits
from unipg.inference.endpoint.server import EndpointServer
from unipg.inference.endpoint.sessions import Observation, Sessions, SessionTrajectory
from unipg.sample.agent import Trajectory, run_concurrently
from unipg.sample.agent_thread import AgentThread, AgentThreads, Played, call_soon_threadsafe
from unipg.sample.event_loop import LEFTOVER_GRACE_SECONDS
from unipg.tasks.base import Example

logger = logging.getLogger(__name__)

ERROR_RESULT_PREFIXES = ("error", "an error occurred")  # a tool result starting so (any case) is a failed call
MAX_RESTARTS = 3  # restarts of an episode's attempts caught on a blocked agents' loop that are no retries


def load_agent(spec: str):
    """The ``run`` function named by ``package.module:run`` or ``path/to/file.py:run``. A file is imported as a
    plugin is (``unipg.config.plugins``): once per process, under a name fixed by its absolute path, so a file
    that is also among ``plugins`` is one module, and a Ray worker imports it as the driver did."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ConfigError(f"task.agent must be 'package.module:function' or 'path/to/file.py:function', got {spec!r}")
    try:
        if where.endswith(".py"):
            path = Path(where).expanduser().resolve()
            if not path.is_file():
                raise ConfigError(f"task.agent: no file {path}")
            try:
                module = import_plugin(str(path))
            except ConfigError as error:
                raise ConfigError(f"task.agent: {error}") from error.__cause__
        else:
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as error:  # noqa: BLE001 — any import failure is the configured agent's
        raise ConfigError(f"task.agent: cannot import {where!r}: {type(error).__name__}: {error}") from error
    run = getattr(module, name, None)
    if not asyncio.iscoroutinefunction(run):
        raise ConfigError(
            f"task.agent: {where!r} has no async function {name!r} "
            "(async def run(base_url, api_key, example) -> float | str | dict)"
        )
    return run


class AgentFailed(Exception):
    """An attempt of the agent that yields no episode: what went wrong, for the failure count."""


class Stranded(AgentFailed):
    """An attempt caught on an agents' event loop that another attempt blocked (``unipg.sample.agent_thread``):
    started again in a fresh session without counting as a retry, up to ``MAX_RESTARTS`` times an episode."""


@dataclass
class ExternalAgent:
    """What one episode plays: the agent's ``run``, and how its answer is scored."""

    run: object  # async (base_url, api_key, example) -> float | str | dict
    reward_fn: object  # the task's reward functions (``acall``)


@dataclass
class EndpointPort:
    """The port a runner's endpoint serves on, kept across its batches of episodes (each serves the endpoint
    anew) so that every episode's agent gets the same base URL."""

    port: int = 0  # 0 until the first batch's endpoint has bound one


@dataclass
class AgentStats:
    """Counts since the last ``pop``; logged as rollout metrics."""

    episodes: int = 0
    failures: int = 0  # episodes that failed on every attempt
    timeouts: int = 0  # attempts that ran past the timeout
    retries: int = 0
    extra_trajectories: int = 0  # trajectories of an episode trained beside its main one (``Trajectory.side``)

    def pop(self) -> AgentStats:
        """The counts so far, and zero them here: a loop counting into this object keeps doing so."""
        counts = dataclasses.replace(self)
        for counter in dataclasses.fields(self):
            setattr(self, counter.name, 0)
        return counts

    def merge(self, other: AgentStats) -> None:
        """Add ``other``'s counts (those of a Ray rollout worker) to these."""
        for counter in dataclasses.fields(self):
            setattr(self, counter.name, getattr(self, counter.name) + getattr(other, counter.name))

    def metrics(self, prefix: str) -> dict[str, float]:
        return {
            f"{prefix}/agent_failures": self.failures,
            f"{prefix}/agent_timeouts": self.timeouts,
            f"{prefix}/agent_retries": self.retries,
            f"{prefix}/agent_extra_trajectories": self.extra_trajectories,
        }


def reported(result) -> tuple[float | None, str | None]:
    """(reward, answer) of what an agent returned; raises ``AgentFailed`` for anything else."""
    if isinstance(result, (int, float)) and not isinstance(result, bool):
        return _finite(result), None
    if isinstance(result, str):
        return None, result
    if isinstance(result, dict) and ("reward" in result or "answer" in result):
        reward, answer = result.get("reward"), result.get("answer")
        if (reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float)))) or (
            answer is not None and not isinstance(answer, str)
        ):
            raise AgentFailed("a returned dict holds reward: number and/or answer: string")
        return (None if reward is None else _finite(reward)), answer
    raise AgentFailed(f"the agent returned a {type(result).__name__}; expected a number, a string or a dict")


def _finite(value) -> float:
    if not math.isfinite(float(value)):
        raise AgentFailed(f"the agent returned a reward of {value}")
    return float(value)


class ExternalAgentLoop:
    """Runs episodes of external agents against the endpoint on ``engine`` (same interface as ``AgentLoop``)."""

    def __init__(
        self,
        engine: HFService,
        tokenizer,
        *,
        eos_ids: list[int],
        endpoint,
        max_tokens: int,
        context_length: int | None,
        describe_tools: bool,
        stats: AgentStats | None = None,
        tool_parser: str | None = None,
        port: EndpointPort | None = None,
        agent_threads: AgentThreads | None = None,
    ):
        """``endpoint``: the ``EndpointConfig`` section; ``max_tokens``: generated tokens per call at most;
        ``tool_parser``: the run's tool-call format (None: the chat template's); ``port``: where earlier batches
        of the run served (the endpoint serves there again; None: ``endpoint.port``); ``agent_threads``: where the
        agents run, kept across batches (None: a thread of this loop's own, ended with ``running``)."""
        self.engine, self.tokenizer, self.endpoint = engine, tokenizer, endpoint
        self.stats = stats if stats is not None else AgentStats()
        self.port = port if port is not None else EndpointPort()
        self.owns_threads = agent_threads is None
        self.agent_threads = agent_threads if agent_threads is not None else AgentThreads()
        self.sessions = Sessions(tokenizer, eos_ids=eos_ids)
        limits = Limits(max_tokens=max_tokens, max_n=endpoint.max_n, context_length=context_length)
        self.completions = Completions(
            engine,
            tokenizer,
            limits,
            any_model_name=endpoint.any_model_name,
            describe_tools=describe_tools,
            tool_parser=tool_parser,
        )
        self.server = EndpointServer(
            self.completions,
            self.sessions,
            host=endpoint.host,
            port=self.port.port or endpoint.port,
            max_body_bytes=endpoint.max_body_bytes,
            allow_remote=endpoint.allow_remote,
        )

    @contextlib.asynccontextmanager
    async def running(self):
        """The engine's batching worker and the endpoint, for the duration of the block."""
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(self.engine.running())
            try:
                await stack.enter_async_context(self.server.serving())
            except OSError as error:
                if self.server.port == self.endpoint.port:
                    raise
                logger.warning(
                    "the endpoint cannot serve again on port %d (%s); it serves on another, so agents get a new "
                    "base URL from here on",
                    self.server.port,
                    error,
                )
                self.server.port = self.endpoint.port
                await stack.enter_async_context(self.server.serving())
            self.port.port = self.server.port
            if self.owns_threads:
                stack.callback(self.agent_threads.close)
            yield self

    async def run_episode(self, agent: ExternalAgent, example: Example, order: int) -> Trajectory:
        self.stats.episodes += 1
        async with self.engine.episode():
            problem, attempt, restarts = None, 0, 0
            while attempt <= self.endpoint.agent_retries:
                try:
                    return await self._attempt(agent, example, order)
                except Stranded as failure:
                    problem, restarts = str(failure), restarts + 1
                    if restarts <= MAX_RESTARTS:
                        continue
                except AgentFailed as failure:
                    problem = str(failure)
                attempt += 1
                if attempt <= self.endpoint.agent_retries:
                    self.stats.retries += 1
        self.stats.failures += 1
        prompt = self.tokenizer(example.prompt, add_special_tokens=False)["input_ids"]
        return Trajectory(example, prompt, infos=[TurnInfo(agent_error=problem)], finish="failed")

    async def _attempt(self, agent: ExternalAgent, example: Example, order: int) -> Trajectory:
        session = self.sessions.open(order)
        try:
            result = await self._call(agent.run(self.server.url, session.key, example))
        finally:
            trajectories = self.sessions.close(session)
        reward, answer = reported(result)
        if session.last is None:
            raise AgentFailed("the agent made no call to the model")
        last = session.last
        scored, info = await final_answer_reward(
            agent.reward_fn, example, answer if answer is not None else last.turn_texts[-1]
        )
        if reward is not None:  # the agent's own reward is the episode's
            info = dataclasses.replace(info, final_reward=reward)
        reward = scored if reward is None else reward
        episode = episode_trajectory(example, last, reward, info)
        episode.side = [
            episode_trajectory(example, other, reward, TurnInfo()) for other in trajectories if other is not last
        ]
        self.stats.extra_trajectories += len(episode.side)
        return episode

    async def _call(self, coroutine):
        """The agent's result, played on the agents' thread (``unipg.sample.agent_thread``), or ``AgentFailed`` when
        it raised or ran past the timeout, ``Stranded`` when another agent blocked its loop; an agent that ignores
        its cancellation is left behind rather than awaited (its mirror task here is what is left)."""
        loop, thread = asyncio.get_running_loop(), self.agent_threads.current()
        played, stalled = thread.submit(coroutine), asyncio.Event()
        task = asyncio.ensure_future(mirror(thread, played))
        forget = thread.on_stall(lambda: call_soon_threadsafe(loop, stalled.set))
        if thread.stalled.is_set():  # blocked before the callback was in place
            stalled.set()
        deadline = loop.time() + self.endpoint.agent_timeout
        try:
            while not task.done() and loop.time() < deadline:
                waiting = {task} if stalled.is_set() else {task, asyncio.ensure_future(stalled.wait())}
                await asyncio.wait(waiting, timeout=deadline - loop.time(), return_when=asyncio.FIRST_COMPLETED)
                for waiter in waiting - {task}:
                    waiter.cancel()
                if not task.done() and stalled.is_set() and thread.blocker is not played.task:
                    abandon(task)
                    raise Stranded("another agent blocked the event loop this attempt ran on")
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            forget()
        if not task.done():
            abandon(task)
            self.stats.timeouts += 1
            raise AgentFailed(f"the agent ran past {self.endpoint.agent_timeout:g} s")
        if task.cancelled():
            raise AgentFailed("the agent's task was cancelled")
        if task.exception() is not None:
            error = task.exception()
            if isinstance(error, Stranded):  # the agents' worker process died under it (``agent_processes``)
                raise error
            raise AgentFailed(f"the agent raised {type(error).__name__}: {str(error)[:200]}")
        return task.result()

    async def run_episodes(
        self, agents: list[ExternalAgent], examples: list[Example], *, concurrency: int | None = None
    ) -> list[Trajectory]:
        """One episode per (agent, example) concurrently; results in input order."""
        async with self.running():
            return await run_concurrently(
                lambda i: self.run_episode(agents[i], examples[i], order=i), len(examples), concurrency
            )


async def mirror(thread: AgentThread, played: Played):
    """``played``'s outcome on the episodes' loop. Its cancellation cancels ``played``; it ends when ``played`` has
    ended, so an agent that ignores its cancellation leaves this task running as it leaves its own."""
    loop, ended = asyncio.get_running_loop(), asyncio.Event()
    played.outcome.add_done_callback(lambda _: call_soon_threadsafe(loop, ended.set))
    while not ended.is_set():
        try:
            await ended.wait()
        except asyncio.CancelledError:
            thread.cancel(played)
            try:
                await asyncio.wait_for(ended.wait(), LEFTOVER_GRACE_SECONDS)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                continue
    if played.outcome.cancelled():
        raise asyncio.CancelledError
    return played.outcome.result()


def abandon(task: asyncio.Task) -> None:
    """Cancel ``task`` and stop waiting for it; what it raises is expected, not to be logged."""
    task.cancel()
    task.add_done_callback(lambda ended: ended.cancelled() or ended.exception())


def episode_trajectory(example: Example, recorded: SessionTrajectory, reward: float, info: TurnInfo) -> Trajectory:
    """The learner's ``Trajectory`` of a session trajectory: one policy turn per call, the reward and ``info`` on
    the last; each earlier turn with what the agent added after it (its tool results) as its observation."""
    turns = recorded.turns
    added = [recorded.observations.get(turn, []) for turn in range(turns - 1)]
    return Trajectory(
        example,
        list(recorded.prompt_ids),
        token_ids=list(recorded.token_ids),
        loss_mask=list(recorded.loss_mask),
        behaviour_logprobs=list(recorded.behaviour_logprobs),
        turn_of_token=list(recorded.turn_of_token),
        step_rewards=[0.0] * (turns - 1) + [reward],
        policy_versions=list(recorded.policy_versions),
        version_changes=list(recorded.version_changes),
        turn_texts=list(recorded.turn_texts),
        infos=[turn_info(observations) for observations in added] + [info],
        finish="done",
        messages=[{"role": "user", "content": example.prompt}] + [observation_message(each) for each in added],
    )


def turn_info(observations: list[Observation]) -> TurnInfo:
    """A turn's facts from what the agent added after it: its tool call, as the built-in loop records one, when
    tool results came back (a turn of several calls: the first call, the results together, status ``error`` if
    one of them is); nothing otherwise."""
    results = [observation for observation in observations if observation.call is not None]
    if not results:
        return TurnInfo()
    call = results[0].call
    failed = any(result.content.strip().lower().startswith(ERROR_RESULT_PREFIXES) for result in results)
    return TurnInfo(
        tool=call.name,
        arguments=json.loads(call.arguments),
        tool_status="error" if failed else "ok",
        observation="\n".join(result.content for result in results),
    )


def observation_message(observations: list[Observation]) -> dict:
    """What the agent added after a turn, as the one observation message an episode record holds per turn: its
    tool results (role ``tool``), else its other messages (role ``user``), the texts one per line."""
    results = [observation for observation in observations if observation.call is not None]
    shown = results or observations
    return {"role": "tool" if results else "user", "content": "\n".join(each.content for each in shown)}
