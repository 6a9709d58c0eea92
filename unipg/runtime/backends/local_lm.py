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
import threading
import time

import torch

from unipg.policy.lm import LMPolicy
from unipg.policy.role_policies import RolePolicies
from unipg.runtime.driver import CountedEpisodes, EpisodeAccount, RolloutReport, WeightSync
from unipg.runtime.replay import Group, ReplayBuffer, StalenessGate
from unipg.sample.episodes import EpisodeRunner
from unipg.sample.event_loop import LEFTOVER_GRACE_SECONDS, run_abandoning
from unipg.sample.roles import role_major

MAX_CANCELLATIONS = 5  # a group cancelled this often from inside its episodes has a bug, not bad luck


def inference_copy(
    policy: LMPolicy | RolePolicies, device: torch.device | str | None = None
) -> LMPolicy | RolePolicies:
    """A sampling-only copy of ``policy``'s language model (no reference, no critic) for the rollout side, on
    ``device`` (None: the policy's own); with a model per role (``RolePolicies``) a copy of each role's, whose
    ``model`` (one ``ModuleDict``) is synced as one.

    Its parameters keep ``requires_grad`` as they are: sampling runs under ``no_grad`` anyway, and CPU kernels
    take another path for weights that do not require grad, which changes results in the last bits — the
    copy samples exactly as the learner's model would."""
    if isinstance(policy, RolePolicies):
        return policy.inference_copy(device)
    model = copy.deepcopy(policy.model)
    return LMPolicy(model if device is None else model.to(device), policy.tokenizer)


def split_groups(trajectories: list, version: int, size: int, roles: int = 1) -> list[Group]:
    """Consecutive runs of ``size`` episodes (``roles`` trajectories each, one after the other) as groups
    started at ``version``; a group of a multi-role task holds its trajectories role after role (``role_major``)."""
    width = size * roles
    return [
        Group(
            role_major([trajectories[start + i * roles : start + (i + 1) * roles] for i in range(size)])
            if roles > 1
            else trajectories[start : start + width],
            version,
            size,
        )
        for start in range(0, len(trajectories), width)
    ]


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
        """Cancel the running groups and wait for them at most ``LEFTOVER_GRACE_SECONDS``: a group whose episode
        ignores its cancellation is left to the loop's end (``run_abandoning``), which does not wait for it."""
        self.closing = True
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=LEFTOVER_GRACE_SECONDS)

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
            outcome = (
                "requeued"
                if rerun
                else "failed"
                if cancelled or error is not None
                else "cancelled"
                if task.cancelled()
                else "finished"
            )
            setattr(self.account, outcome, getattr(self.account, outcome) + self.group_size)
        if rerun:
            self.start(example, version, order, cancellations)
        elif cancelled:
            self.failure.append(
                RuntimeError(
                    f"a group of episodes was cancelled {cancellations} times from inside "
                    "its episodes (something there cancels its task); rollout cannot go on"
                )
            )
        elif error is not None:
            self.failure.append(error)
        if not self.tasks:
            self.idle_since = time.perf_counter()
        self._ended.set()


class LMRollout(CountedEpisodes):
    """Runs groups of episodes for the runtime (module docstring)."""

    def __init__(
        self,
        runner: EpisodeRunner,
        sampler,
        generator: torch.Generator,
        weights: WeightSync | None = None,
        *,
        group_size: int,
        concurrency: int,
        owns_runner: bool = False,
    ):
        """``group_size``: episodes per prompt (``sample.samples_per_prompt``); ``concurrency``: episodes the
        concurrent schedule runs at once (``agent.concurrency``); ``owns_runner``: the runner (and its
        environment service) is this rollout's own, closed with it."""
        self.runner, self.sampler, self.generator, self.weights = runner, sampler, generator, weights
        self.owns_runner, self.group_size, self.concurrency = owns_runner, group_size, concurrency
        self.batch_sizes: list[int] = []  # the sequential schedule's generate calls since the last report
        self.generate_seconds = 0.0
        self.idle_seconds = 0.0
        self._service = None  # the concurrent schedule's inference service while it serves
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
        """Run admitted groups on an asyncio loop of this thread until ``stop`` is set (module docstring); the
        loop ends without waiting for tasks that ignore their cancellation (``run_abandoning``)."""

        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            try:
                await self._serve(gate, buffer, stop)
            finally:
                self._loop = None

        run_abandoning(serve(), on_left=self.runner.count_left_running)

    async def _serve(self, gate: StalenessGate, buffer: ReplayBuffer, stop: threading.Event) -> None:
        service = self.runner.inference_service(
            self.generator, sync=self.weights.pull if self.weights is not None else None
        )
        self._service = service
        loop = self.runner.agent_loop(service)

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
                service.pop_batches()  # the counts of a run that stopped are not reported
                self._service = None

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

    def report(self) -> RolloutReport:
        """Since the last report: the generate calls, the seconds the concurrent schedule ran no group (0.0 in the
        sequential one), the weight syncs (None: sampling on the learner's own weights), the runner's environment
        service and engine counters; and the episode counts."""
        service = self._service
        if service is not None:  # the concurrent schedule's, counting on the rollout thread
            sizes, seconds = service.pop_batches()
        else:
            sizes, seconds = self.batch_sizes, self.generate_seconds
            self.batch_sizes, self.generate_seconds = [], 0.0
        with self._lock:
            idle, self.idle_seconds = self.idle_seconds, 0.0
        counters = {**self.runner.pop_service_metrics("rollout"), **self.runner.pop_engine_metrics()}
        return RolloutReport(
            sizes,
            seconds,
            idle,
            self.weights.pop_seconds() if self.weights is not None else None,
            counters,
            self.counted_episodes(),
        )

    def close(self) -> None:
        """Close the runner if it is this rollout's own (concurrent schedule); the driver closes its own."""
        if self.owns_runner:
            self.runner.close()
