"""The rollout side of an lm run, for ``unipg.runtime.driver``: groups of episodes of one prompt each.

A group is the ``samples_per_prompt`` episodes of one prompt (the GRPO group), written to the replay buffer
when its last episode ends, so a group is never split.

- ``produce(count, version)`` (sequential schedule): draw ``count`` prompts and run all their episodes
  together through one inference engine on the learner's own weights — exactly the rollout of synchronous
  training.
- ``serve(gate, buffer, stop)`` (concurrent schedule): an asyncio loop on a background thread. It starts a
  new group whenever the gate admits one (and fewer than ``agent.concurrency`` episodes run), so episodes of
  many groups interleave in one inference engine with dynamic batching, on a copy of the weights that the
  engine refreshes from ``WeightSync`` between generate calls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import random
import statistics
import threading
import time

import torch

from unipg.learn.lm import LMBatch
from unipg.policy.lm import LMPolicy
from unipg.runtime.driver import (
    CountedEpisodes,
    EpisodeAccount,
    Rollout,
    WeightSync,
    staleness_histogram,
)
from unipg.runtime.replay import Group, ReplayBuffer, StalenessGate
from unipg.sample.episodes import EpisodeRunner, episode_metrics, reward_term_metrics, role_metrics
from unipg.sample.roles import role_major

MAX_CANCELLATIONS = 5  # a group cancelled this often from inside its episodes has a bug, not bad luck


def inference_copy(policy: LMPolicy, device: torch.device | str | None = None) -> LMPolicy:
    """A sampling-only copy of ``policy``'s language model (no reference, no critic) for the rollout side, on
    ``device`` (None: the policy's own).

    Its parameters keep ``requires_grad`` as they are: sampling runs under ``no_grad`` anyway, and CPU kernels
    take another path for weights that do not require grad, which changes results in the last bits — the
    copy samples exactly as the learner's model would."""
    model = copy.deepcopy(policy.model)
    return LMPolicy(model if device is None else model.to(device), policy.tokenizer)


def split_groups(trajectories: list, version: int, size: int, roles: int = 1) -> list[Group]:
    """Consecutive runs of ``size`` episodes (``roles`` trajectories each, one after the other) as groups
    started at ``version``; a group of a multi-role task holds its trajectories role after role (``role_major``)."""
    width = size * roles
    return [Group(role_major([trajectories[start + i * roles:start + (i + 1) * roles] for i in range(size)])
                  if roles > 1 else trajectories[start:start + width], version, size)
            for start in range(0, len(trajectories), width)]


class RunningGroups:
    """The groups the concurrent schedule runs at once, and what happens when one ends, counted in ``account``:
    a finished group has written itself to the buffer; a group cancelled by ``interrupt`` runs again from its
    first turn (``requeued``), as does one cancelled from inside its episodes, up to ``MAX_CANCELLATIONS``
    times (then ``failed``, and rollout stops); a group that raised stops rollout (``failure``); groups still
    running when rollout closes are ``cancelled``."""

    def __init__(self, run_group, account: EpisodeAccount, lock: threading.Lock, group_size: int):
        self.run_group, self.account, self.lock, self.group_size = run_group, account, lock, group_size
        self.tasks: dict[asyncio.Task, tuple] = {}  # task -> (example, version, order, cancellations from inside)
        self.interrupted: set[asyncio.Task] = set()
        self.failure: list[BaseException] = []
        self.closing = False  # rollout is stopping: cancelled groups are not run again
        self.idle_since = time.perf_counter()  # when the last group ended, while none runs
        self._ended = asyncio.Event()

    def __len__(self) -> int:
        return len(self.tasks)

    def start(self, example, version: int, order: int, cancellations: int = 0) -> None:
        with self.lock:
            self.account.started += self.group_size
            self.account.in_flight += self.group_size
        task = asyncio.create_task(self.run_group(example, version, order))
        self.tasks[task] = (example, version, order, cancellations)
        task.add_done_callback(self._ended_callback)

    def interrupt(self, count: int) -> int:
        """Cancel up to ``count`` running groups, chosen at random, to be run again; how many were cancelled."""
        chosen = random.sample(list(self.tasks), min(count, len(self.tasks)))
        self.interrupted.update(chosen)
        return sum(task.cancel() for task in chosen)

    async def wait_for_an_end(self) -> None:
        self._ended.clear()
        await self._ended.wait()

    async def close(self) -> None:
        self.closing = True
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def _ended_callback(self, task: asyncio.Task) -> None:
        example, version, order, cancellations = self.tasks.pop(task)
        cancelled = task.cancelled() and not self.closing
        if cancelled and task not in self.interrupted:  # cancelled from inside the episode, not by ``interrupt``
            cancellations += 1
        rerun = cancelled and cancellations < MAX_CANCELLATIONS
        self.interrupted.discard(task)
        error = None if task.cancelled() else task.exception()
        with self.lock:
            self.account.in_flight -= self.group_size
            outcome = ("requeued" if rerun else "failed" if cancelled or error is not None else
                       "cancelled" if task.cancelled() else "finished")
            setattr(self.account, outcome, getattr(self.account, outcome) + self.group_size)
        if rerun:
            self.start(example, version, order, cancellations)
        elif cancelled:
            self.failure.append(RuntimeError(f"a group of episodes was cancelled {cancellations} times from inside "
                                             "its episodes (something there cancels its task); rollout cannot go on"))
        elif error is not None:
            self.failure.append(error)
        if not self.tasks:
            self.idle_since = time.perf_counter()
        self._ended.set()


class LMRollout(CountedEpisodes):
    """Runs groups of episodes for the runtime (module docstring)."""

    def __init__(self, runner: EpisodeRunner, sampler, generator: torch.Generator, weights: WeightSync | None = None,
                 *, group_size: int, concurrency: int, owns_runner: bool = False):
        """``group_size``: episodes per prompt (``sample.samples_per_prompt``); ``concurrency``: episodes the
        concurrent schedule runs at once (``agent.concurrency``); ``owns_runner``: the runner (and its
        environment service) is this rollout's own, closed with it."""
        self.runner, self.sampler, self.generator, self.weights = runner, sampler, generator, weights
        self.owns_runner, self.group_size, self.concurrency = owns_runner, group_size, concurrency
        self.batch_sizes: list[int] = []
        self.generate_seconds = 0.0
        self.idle_seconds = 0.0
        self._engine = None  # the concurrent schedule's inference engine while it serves
        self._loop = self._interrupt = None  # its event loop, and how to cancel running groups, while it serves
        self.account = EpisodeAccount()
        self._lock = threading.Lock()

    def produce(self, count: int, version: int) -> list[Group]:
        """``count`` groups of the next prompts, all episodes run together on the runner's weights."""
        examples = self.sampler.next(count)
        repeated = [example for example in examples for _ in range(self.group_size)]
        with self._lock:
            self.account.started += len(repeated)
            self.account.in_flight += len(repeated)
        finished = False
        try:
            episodes = self.runner.run(repeated, generator=self.generator, policy_version=version, all_roles=True)
            finished = True
        finally:
            with self._lock:
                self.account.in_flight -= len(repeated)
                if finished:
                    self.account.finished += len(repeated)
                else:
                    self.account.failed += len(repeated)
        self.batch_sizes += episodes.batch_sizes
        self.generate_seconds += episodes.generate_seconds
        return split_groups(episodes.trajectories, version, self.group_size, max(len(self.runner.roles), 1))

    def publish(self, version: int) -> None:
        """Snapshot the learner's weights for the rollout's copy (nothing to do when it samples with the learner's)."""
        if self.weights is not None:
            self.weights.publish(version)

    def serve(self, gate: StalenessGate, buffer: ReplayBuffer, stop: threading.Event) -> None:
        """Run admitted groups on an asyncio loop of this thread until ``stop`` is set (module docstring)."""

        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            try:
                await self._serve(gate, buffer, stop)
            finally:
                self._loop = None

        asyncio.run(serve())

    async def _serve(self, gate: StalenessGate, buffer: ReplayBuffer, stop: threading.Event) -> None:
        engine = self.runner.inference_service(self.generator,
                                               sync=self.weights.pull if self.weights is not None else None)
        self._engine = engine
        loop = self.runner.agent_loop(engine)

        async def run_group(example, version: int, order: int) -> None:
            envs = [self.runner.make_env() for _ in range(self.group_size)]
            episodes = [loop.run_episode(env, example, order=order * self.group_size + i) for i, env in enumerate(envs)]
            finished = list(await asyncio.gather(*episodes))
            items = role_major(finished) if self.runner.roles else finished
            buffer.put(Group(items, version, self.group_size))

        groups = RunningGroups(run_group, self.account, self._lock, self.group_size)
        most = max(self.concurrency // self.group_size, 1)  # groups running at once
        self._interrupt = groups.interrupt
        async with loop.running():
            order = 0
            try:
                while not stop.is_set() and not groups.failure:
                    if len(groups) >= most:
                        await groups.wait_for_an_end()
                        continue
                    admitted = await asyncio.to_thread(gate.admit, self.group_size, 0.05, most=most - len(groups))
                    if admitted is None:
                        continue
                    version, count = admitted
                    if not groups:
                        with self._lock:
                            self.idle_seconds += time.perf_counter() - groups.idle_since
                    for example in self.sampler.next(count):  # all admitted groups start in this one step
                        groups.start(example, version, order)
                        order += 1
                if groups.failure:
                    raise groups.failure[0]
            finally:
                self._interrupt = None
                await groups.close()
                self.pop_generation()  # the counts of a run that stopped are not reported
                self._engine = None

    def interrupt(self, groups: int = 1) -> int:
        """Cancel up to ``groups`` running groups of the concurrent schedule, from any thread; each is started
        again from its first turn (counted in ``rollout/episodes_requeued``). Fault injection uses it to check
        that a lost episode task costs time, not data. Returns how many were asked to stop."""
        interrupt, engine_loop = self._interrupt, self._loop
        if interrupt is None or engine_loop is None:
            return 0

        async def on_the_loop() -> int:
            return interrupt(groups)

        try:
            return asyncio.run_coroutine_threadsafe(on_the_loop(), engine_loop).result(timeout=10)
        except (RuntimeError, concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            return 0  # rollout stopped in the meantime: nothing is running to interrupt

    def pop_service_metrics(self, prefix: str) -> dict[str, float]:
        """The runner's environment service counters under ``prefix`` and the episode counts."""
        with self._lock:
            account = self.account.metrics()
        return {**self.runner.pop_service_metrics(prefix), **self.runner.pop_engine_metrics(), **account}

    def pop_sync_seconds(self) -> float | None:
        """Seconds spent publishing and loading weights since the last call (None: no weight sync)."""
        return self.weights.pop_seconds() if self.weights is not None else None

    def close(self) -> None:
        """Close the runner if it is this rollout's own (concurrent schedule); the driver closes its own."""
        if self.owns_runner:
            self.runner.close()

    def pop_idle_seconds(self) -> float:
        """Seconds the concurrent schedule ran no group, since the last call (0.0 in the sequential one)."""
        with self._lock:
            seconds, self.idle_seconds = self.idle_seconds, 0.0
            return seconds

    def pop_generation(self) -> tuple[list[int], float]:
        """Sizes of the generate calls and their seconds since the last call."""
        engine = self._engine
        if engine is not None:  # the concurrent schedule's engine, counting on the rollout thread
            return engine.pop_batches()
        sizes, seconds = self.batch_sizes, self.generate_seconds
        self.batch_sizes, self.generate_seconds = [], 0.0
        return sizes, seconds


def group_signal_metrics(scores: torch.Tensor, correct: list[bool], group_size: int) -> dict[str, float]:
    """How many prompt groups can teach anything. ``scores``: (B,) episode returns, group after group;
    ``correct``: whether each episode completed the task.

    - ``rollout/uniform_group_fraction``: groups whose returns are all equal: a group-relative advantage is zero
      for every episode of such a group, so it contributes no gradient (GRPO, RLOO);
    - ``rollout/unsolved_group_fraction``: groups in which no episode completed the task;
    - ``rollout/solved_group_fraction``: groups in which every episode did.
    """
    grouped = torch.tensor(correct, dtype=torch.bool).view(-1, group_size)
    uniform = scores.view(-1, group_size).std(dim=1) == 0 if group_size > 1 else torch.zeros(1, dtype=torch.bool)
    return {"rollout/uniform_group_fraction": float(uniform.float().mean()),
            "rollout/unsolved_group_fraction": float((~grouped.any(dim=1)).float().mean()),
            "rollout/solved_group_fraction": float(grouped.all(dim=1).float().mean())}


def mixed_returns(group: Group) -> bool:
    """Whether the episodes of ``group`` differ in return, so that a group-relative advantage is not zero for
    all of them (the test of dynamic sampling; ``rollout/uniform_group_fraction`` counts the groups failing it)."""
    return len({t.reward for t in group.items}) > 1


def group_index(groups: list[Group]) -> list[int]:
    """The group of each episode of ``groups`` (all their items, in order) for the group estimators: the
    episodes of one ``Group`` that play one role (all of them, in a one-role task)."""
    numbers: dict[tuple, int] = {}
    return [numbers.setdefault((number, t.role), len(numbers)) for number, g in enumerate(groups) for t in g.items]


def rollout_batch(groups: list[Group], rollout: Rollout, version: int, seconds: float, *, group_size: int,
                  pad_id: int, tools: bool, offline: list[Group] = ()) -> tuple[LMBatch, dict[str, float]]:
    """The learner's batch from ``groups`` (group after group, each ``group_size`` episodes per role, padded
    with ``pad_id``), then the ``offline`` groups, and the rollout metrics of the step (of ``groups`` only), read
    from ``rollout``'s reporting methods; ``seconds`` is the step's time spent waiting for rollout; ``tools``:
    the episodes may call tools (their metrics are reported)."""
    group = group_size
    trajectories = [t for g in groups for t in g.items]
    episodes = trajectories + [t for g in offline for t in g.items]
    batch = LMBatch.from_trajectories(episodes, pad_id, version=version, groups=group_index([*groups, *offline]))
    online = sum(len(t.rows) for t in trajectories)  # rows: an episode's side ones included
    scores = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)  # (episodes,)
    lengths = batch.completion_mask[:online].sum(1)
    sizes, generate_seconds = rollout.pop_generation()
    metrics = {"rollout/reward_mean": float(scores.mean()), "rollout/reward_std": float(scores.std()),
               "rollout/response_length_max": float(lengths.max()), "rollout/generated_tokens": float(lengths.sum()),
               "timing/generate": generate_seconds,
               # generation and environment steps interleave: env is the rollout time not spent generating
               "timing/env": max(seconds - generate_seconds, 0.0)}
    if sizes:
        metrics["rollout/generate_batch_mean"] = statistics.fmean(sizes)
    metrics.update(episode_metrics(trajectories, "rollout", group_size=group, tools=tools))
    metrics.update(role_metrics(trajectories, "rollout", tools=tools))
    metrics.update(reward_term_metrics(trajectories, "rollout"))
    metrics.update(rollout.pop_service_metrics("rollout"))
    metrics.update(group_signal_metrics(scores, [t.correct for t in trajectories], group))
    metrics.update(staleness_histogram(batch.ages[:online], batch.completion_mask[:online], "async/staleness_token"))
    sync_seconds = rollout.pop_sync_seconds()
    if sync_seconds is not None:
        metrics["timing/weight_sync"] = sync_seconds
    return batch, metrics
