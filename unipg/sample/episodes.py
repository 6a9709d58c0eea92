"""Episodes of an lm run: environments, the environment service and the inference engine (their metrics are
``unipg.observe.rollout_metrics``).

Every text task runs through the agent loop; a single-turn task is the one-step case (``single_turn``
environment, no tools), a task with tools runs the ``tool`` environment with up to ``max_turns`` policy
turns. ``EpisodeRunner`` builds these pieces once per run from the config and the task, and turns a list
of examples into trajectories.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from unipg.config import Config, ConfigError
from unipg.envs import ENVS, EnvironmentService
from unipg.envs.service import build_tools, close_tools
from unipg.inference import ENGINES, Engine, HFService, SamplingParams
from unipg.policy.chat import TurnTemplate, render_agent_prompt
from unipg.policy.lm import LMPolicy
from unipg.policy.tool_calls import TOOL_PARSERS, parser_for_template, rewrite_calls
from unipg.sample.agent import AgentLoop, Trajectory
from unipg.sample.agent_processes import agent_threads, played_by
from unipg.sample.endpoint_agents import AgentStats, EndpointPort, ExternalAgent, ExternalAgentLoop, load_agent
from unipg.sample.event_loop import EpisodeLoop
from unipg.sample.roles import RoleLoop
from unipg.tasks.base import Example, Task, make_task, with_validation


class PromptEncoder:
    """Renders (chat template, tool descriptions) and tokenises first observations once each; keeps the last
    ``max_length`` tokens."""

    def __init__(self, tokenizer, *, system_prompt: str | None, max_length: int, tools: list[dict] | None = None):
        self.tokenizer, self.system_prompt, self.max_length, self.tools = tokenizer, system_prompt, max_length, tools
        self._cache: dict[str, list[int]] = {}

    def render(self, prompt: str | list[dict]) -> str:
        return render_agent_prompt(self.tokenizer, prompt, self.system_prompt, self.tools)

    def __call__(self, prompt: str | list[dict]) -> list[int]:
        key = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)  # a conversation, hashable
        if key not in self._cache:
            ids = self.tokenizer(self.render(prompt), add_special_tokens=False)["input_ids"]
            self._cache[key] = ids[-self.max_length :]
        return self._cache[key]


def tool_specs(config: Config, task: Task) -> list[dict]:
    """The tools of a run: ``task.tools`` from the config, else the task's own."""
    return config.task.tools if config.task.tools is not None else task.tools


def build_task(config: Config, task: Task | None = None, **options) -> Task:
    """The task of an lm run with its validation split of ``eval.validation_examples`` (``with_validation``):
    ``task`` when the caller built it, else ``task.name`` built with ``task.options``, ``options`` replacing some of
    them (as an SFT stage's do). Every part of a run builds its task here, so all of them carve the same
    validation split out of train."""
    if task is not None:
        return with_validation(task, size=config.eval.validation_examples)
    settings = {**config.task.options, **options}
    return make_task(config.task.name, validation_examples=config.eval.validation_examples, **settings)


def held_out(task: Task, config: Config) -> list[Example]:
    """The examples reported on: the task's test split, cut to ``eval.max_examples``. Only reports read it (a run's
    ``eval/…`` metrics, ``unipg eval``, ``unipg sft``'s before and after); decisions read ``task.validation``."""
    return task.test[: config.eval.max_examples] if config.eval.max_examples else task.test


def role_system_prompt(config: Config, task: Task, role: str) -> str | None:
    """The system prompt of ``role``: ``agent.roles.<role>.system_prompt``, else the task's for the role."""
    settings = config.agent.roles.get(role)
    return settings.system_prompt if settings is not None and settings.system_prompt is not None else task.roles[role]


def check_roles(config: Config, task: Task) -> None:
    """Refuse role settings that do not fit ``task``, with the fix."""
    unknown = sorted(set(config.agent.roles) - set(task.roles))
    if unknown:
        valid = ", ".join(task.roles) or "none: it is a one-role task"
        raise ConfigError(
            f"agent.roles names {', '.join(unknown)}, not a role of task '{task.name}' (its roles: {valid})"
        )
    if task.roles and config.backend not in ("inprocess", "ray"):
        raise ConfigError(
            f"task '{task.name}' has roles ({', '.join(task.roles)}); multi-role episodes run on "
            f"backend=inprocess or backend=ray only in this version, not '{config.backend}'"
        )


def demonstration_pairs(tokenizer, task: Task, config: Config, examples: list[Example]) -> list[tuple]:
    """(rendered prompt, completion) pairs for SFT, rendered exactly as rollouts render them: the same
    system prompt and tool descriptions, and multi-turn demonstrations as the loop lays out turns. A multi-role
    task gives each example's demonstrations of every role, each rendered with its role's system prompt."""
    specs = tool_specs(config, task)
    schemas = None
    if specs and config.agent.tool_prompt:
        tools = build_tools(specs)
        close_tools(tools)  # only their descriptions are needed here (an MCP server need not keep running)
        schemas = [tool.schema() for tool in tools.values()]
    encoders = {
        role: PromptEncoder(
            tokenizer,
            system_prompt=role_system_prompt(config, task, role),
            max_length=config.sample.max_prompt_length,
            tools=schemas,
        )
        for role in task.roles
    }
    encoders[None] = PromptEncoder(
        tokenizer,
        system_prompt=config.task.system_prompt or task.system_prompt,
        max_length=config.sample.max_prompt_length,
        tools=schemas,
    )
    template = TurnTemplate(tokenizer, multi_turn=any(not isinstance(example.solution, str) for example in examples))
    parser = config.model.tool_parser or parser_for_template(tokenizer.chat_template)

    def in_format(message: dict) -> dict:  # tasks write calls in the hermes format
        if message["role"] != "assistant":
            return message
        return {**message, "content": rewrite_calls(message["content"], parser)}

    shown = (
        [demo for example in examples for demo in task.role_demonstrations(example)]
        if task.roles
        else [(None, example.prompt, example.solution) for example in examples]
    )
    return [
        (
            encoders[role].render(observation),
            solution
            if isinstance(solution, str)
            else template.demonstration([in_format(message) for message in solution]),
        )
        for role, observation, solution in shown
    ]


@dataclass
class Episodes:
    """What ``EpisodeRunner.run`` returns: the episodes, and what generating them took."""

    trajectories: list[Trajectory]  # one per example (per role with ``all_roles``), in input order
    batch_sizes: list[int]  # sequences in each generate call
    generate_seconds: float  # seconds spent in those calls


class EpisodeRunner:
    """Runs batches of episodes of one task with one policy."""

    def __init__(
        self, policy: LMPolicy, task: Task, config: Config, reward_fn, *, tools: dict | None = None, remote_tools=None
    ):
        """``tools``: built tools by name (default: built from the config's or the task's specs);
        ``remote_tools``: where tool calls run, if not in this process (``EnvironmentService``'s ``remote``)."""
        self.policy, self.task, self.config, self.reward_fn = policy, task, config, reward_fn
        agent = config.agent
        self.external = load_agent(config.task.agent) if config.task.agent else None  # the user's own agent
        self.agent_stats = AgentStats()
        # kept across batches: where an external agent's endpoint serves, and the thread its agents run on
        self.endpoint_port, self.agent_threads = EndpointPort(), agent_threads(config.task.agent, config.endpoint)
        self.episode_loop = EpisodeLoop()  # the event loop of ``run``'s batches, kept across them
        self.tasks_left_running = 0  # tasks ``run`` left running when its episodes ended, since the last pop
        specs = tool_specs(config, task) if self.external is None else None  # an external agent has its own tools
        self.max_turns = agent.max_turns or task.max_turns
        self.service = None
        if specs:
            self.service = EnvironmentService(
                tools if tools is not None else build_tools(specs),
                timeout=agent.tool_timeout,
                retries=agent.tool_retries,
                backoff=agent.retry_backoff,
                default_observation=agent.default_observation,
                failure_penalty=agent.failure_penalty,
                seed=config.seed,
                remote=remote_tools,
            )
            if self.max_turns < 2:
                raise ValueError(
                    f"task '{task.name}' has tools but max_turns is {self.max_turns}; an agent needs at "
                    "least 2 turns (call a tool, then answer): raise agent.max_turns"
                )
        schemas = (
            [tool.schema() for tool in self.service.tools.values()] if self.service and agent.tool_prompt else None
        )
        max_prompt = config.sample.max_prompt_length
        if policy.context_length is not None:  # leave the model room to answer
            max_prompt = min(max_prompt, policy.context_length - 1)
        self.encode = PromptEncoder(
            policy.tokenizer,
            system_prompt=config.task.system_prompt or task.system_prompt,
            max_length=max_prompt,
            tools=schemas,
        )
        check_roles(config, task)
        self.roles = list(task.roles)  # empty for a one-role task
        self.role_encoders = {
            role: PromptEncoder(
                policy.tokenizer,
                max_length=max_prompt,
                tools=schemas,
                system_prompt=role_system_prompt(config, task, role),
            )
            for role in self.roles
        }
        self.template = TurnTemplate(policy.tokenizer, multi_turn=self.max_turns > 1)
        self.tool_parser = config.model.tool_parser or parser_for_template(policy.tokenizer.chat_template)
        self.engine_name = config.sample.engine
        ENGINES.get(self.engine_name)  # an unknown name fails here, listing the engines
        self._engine: Engine | None = None  # built on first use: starting vLLM takes seconds

    def encoder_for(self, role: str | None) -> PromptEncoder:
        """The prompt encoder of ``role``'s first observations (None: the run's one role)."""
        return self.encode if role is None else self.role_encoders[role]

    @property
    def engine(self) -> Engine:
        """This runner's inference engine (``sample.engine``), started on first use and closed with the runner."""
        if self._engine is None:
            self._engine = ENGINES.get(self.engine_name)(self.policy, self.config)
        return self._engine

    def make_env(self):
        """A fresh environment for one episode: the config's ``task.env`` with its ``task.env_options`` (over the
        task's own options when it names the task's environment), else the task's own ``env``, else ``tool`` for a
        task with tools and ``single_turn`` for one without. Options the environment declares and the config
        leaves unset come from the run: the call format (``tool_parser``) and the process-reward weight
        (``agent.process_weight``, else the task's); a multi-role task's environment gets the roles' shaping."""
        if self.external is not None:
            return ExternalAgent(played_by(self.agent_threads, self.external), self.reward_fn)
        name, options = self.task.env, dict(self.task.env_options)
        chosen = self.config.task
        if chosen.env is not None:
            options = {**options, **chosen.env_options} if chosen.env == name else dict(chosen.env_options)
            name = chosen.env
        if name is None:
            name = "single_turn" if self.service is None else "tool"
        declared = ENVS.options(name)
        if self.roles:
            options["shaping"] = {role: settings.shaping for role, settings in self.config.agent.roles.items()}
        if "tool_parser" in declared:  # calls in the run's format
            options.setdefault("tool_parser", self.tool_parser)
        if "process_weight" in declared:
            weight = self.config.agent.process_weight
            options.setdefault("process_weight", self.task.process_weight if weight is None else weight)
        return ENVS.get(name)(self.task, self.reward_fn, self.service, **options)

    def sampling(self, *, greedy: bool = False) -> SamplingParams:
        sample = self.config.sample
        # the parser needs a call's closing tag
        keep = TOOL_PARSERS.get(self.tool_parser).stop if self.service is not None else ()
        if greedy:
            return SamplingParams(temperature=0.0, stop=self._stop(), keep_stop=keep)
        return SamplingParams(sample.temperature, sample.top_p, sample.top_k, self._stop(), keep)

    def _stop(self) -> list[str] | None:
        stop = list(self.config.sample.stop)
        if self.service is not None:  # a call is complete at its closing tag; the tool can run right away
            stop += [tag for tag in TOOL_PARSERS.get(self.tool_parser).stop if tag not in stop]
        return stop or None

    def inference_service(
        self,
        generator: torch.Generator | None,
        *,
        params: SamplingParams | None = None,
        sync: Callable[[], int | None] | None = None,
    ) -> HFService:
        """The inference service for a batch of episodes on this runner's engine, sampling with ``params`` (None:
        the run's, ``sampling()``); ``sync``: pull newer weights between generate calls."""
        wait = None if self.config.deterministic else self.config.agent.batch_wait_ms / 1000
        return self.engine.service(
            params or self.sampling(), generator, batch_wait=wait, max_batch=self.config.agent.concurrency, sync=sync
        )

    def agent_loop(self, engine: HFService) -> AgentLoop | ExternalAgentLoop | RoleLoop:
        """The loop of this task's episodes: an ``ExternalAgentLoop`` for an external agent (``task.agent``), a
        ``RoleLoop`` for a multi-role task (episodes → one trajectory per role), else an ``AgentLoop``."""
        if self.external is not None:
            return ExternalAgentLoop(
                engine,
                self.policy.tokenizer,
                eos_ids=self.policy.eos_ids,
                endpoint=self.config.endpoint,
                max_tokens=self.config.sample.max_new_tokens,
                context_length=self.policy.context_length,
                describe_tools=self.config.agent.tool_prompt,
                stats=self.agent_stats,
                tool_parser=self.tool_parser,
                port=self.endpoint_port,
                agent_threads=self.agent_threads,
            )
        if self.roles:
            return RoleLoop(
                engine,
                self.template,
                self.role_encoders,
                max_turns=self.max_turns,
                max_new_tokens=self.config.sample.max_new_tokens,
                max_total_tokens=self.config.agent.max_total_tokens,
                context_length=self.policy.context_length,
                role_adapters=self.config.agent.role_policy != "shared",  # adapters or separate: requests name roles
            )
        return AgentLoop(
            engine,
            self.template,
            self.encode,
            max_turns=self.max_turns,
            max_new_tokens=self.config.sample.max_new_tokens,
            max_total_tokens=self.config.agent.max_total_tokens
            if self.max_turns > 1
            else self.config.sample.max_new_tokens,
            context_length=self.policy.context_length,
        )

    def run(
        self,
        examples: list[Example],
        *,
        generator: torch.Generator | None,
        params: SamplingParams | None = None,
        policy_version: int = 0,
        all_roles: bool = False,
    ) -> Episodes:
        """One episode per example (repeat examples for groups), sampled with ``params`` (None: the run's);
        trajectories in input order. A multi-role episode gives its first role's trajectory (which carries the
        team's outcome), or with ``all_roles`` every role's, one after the other. They run on the runner's event
        loop, kept from one call to the next (``EpisodeLoop``), an external agent on ``agent_threads``; a call ends
        without waiting for tasks that ignore their cancellation, counted in ``tasks_left_running``."""
        return self.episode_loop.run(
            self.arun(examples, generator=generator, params=params, policy_version=policy_version, all_roles=all_roles),
            on_left=self.count_left_running,
        )

    def count_left_running(self, tasks: int) -> None:
        """Count ``tasks`` left running by an event loop of this runner's episodes (``run_abandoning``)."""
        self.tasks_left_running += tasks

    async def arun(
        self,
        examples: list[Example],
        *,
        generator: torch.Generator | None,
        params: SamplingParams | None = None,
        policy_version: int = 0,
        all_roles: bool = False,
    ) -> Episodes:
        """``run`` on the running event loop."""
        service = self.inference_service(generator, params=params)
        service.policy_version = policy_version
        envs = [self.make_env() for _ in examples]
        trajectories = await self.agent_loop(service).run_episodes(
            envs, examples, concurrency=self.config.agent.concurrency
        )
        if self.roles:
            trajectories = [t for episode in trajectories for t in (episode if all_roles else episode[:1])]
        return Episodes(trajectories, *service.pop_batches())

    def pop_service_metrics(self, prefix: str) -> dict[str, float]:
        """The environment service's (or the external agent's) counts since the last call, and
        ``<prefix>/tasks_left_running`` when an event loop of episodes was closed with tasks that ignored their
        cancellation still running (a tool or an agent that swallows ``CancelledError``)."""
        left, self.tasks_left_running = self.tasks_left_running, 0
        metrics = {f"{prefix}/tasks_left_running": left} if left else {}
        if self.external is not None:  # zeroed in place: the concurrent schedule's loop keeps counting into it
            return {**self.agent_stats.pop().metrics(prefix), **metrics}
        return metrics if self.service is None else {**self.service.pop_stats().metrics(prefix), **metrics}

    def pop_engine_metrics(self) -> dict[str, float]:
        """The engine's counters since the last call (none before it started)."""
        return self._engine.metrics() if self._engine is not None else {}

    def close(self) -> None:
        try:
            self.episode_loop.close()
            self.agent_threads.close()
            if self.service is not None:
                self.service.close()
        finally:
            if self._engine is not None:
                engine, self._engine = self._engine, None
                engine.close()


def greedy_completion_rate(model, tokenizer, task: Task, config: Config, examples: list[Example]) -> float:
    """Share of ``examples`` whose greedy episode ends with the reference answer (the task completion rate)."""
    from unipg.tasks.rewards.rules import build_rewards

    runner = EpisodeRunner(LMPolicy(model, tokenizer), task, config, build_rewards(config.task.rewards or task.rewards))
    try:
        episodes = runner.run(examples, params=runner.sampling(greedy=True), generator=None)
        return statistics.fmean(t.correct for t in episodes.trajectories)
    finally:
        runner.close()
