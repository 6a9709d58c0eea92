"""The Ray backend: the runtime's rollout side on Ray actors, with fault tolerance (``backend: ray``).

The driver loop is the one of the in-process backend (``unipg.runtime.lm.train_lm``); only the ``Rollout``
behind ``unipg.runtime.driver.Runtime`` changes. Where the roles run:

- **learner, replay buffer, staleness gate**: the driver process. The buffer has one consumer, the learner,
  so it lives beside it: each trajectory crosses the network once (worker → learner), the buffer survives
  any worker, and a ``breakpoint()`` in the learner still works. On a cluster, put the driver where the
  learner should run (``ray job submit --entrypoint-num-gpus 1 -- unipg train ...``). With
  ``train.learner_processes`` > 1 the learner's ranks are actors of their own (``ray_learner``) and the driver
  keeps the learner's handle and an unsharded copy of the policy, from which it publishes.
- **rollout workers** (``ray.rollout_workers`` × ``RolloutWorker``): each holds its own copy of the policy
  and an inference engine with dynamic batching, and runs up to ``ray.episodes_per_worker`` episodes at once;
  on the nodes that have the custom resources of ``ray.rollout_resources`` (``ray.env_resources`` for the
  environment actors).
- **environment actors** (``ray.env_workers`` × ``EnvActor``): run the tool calls, so a slow, hanging or
  crashing tool never blocks a rollout worker's event loop. The worker's environment service keeps its
  policy (timeouts, retries, default observation, penalties) and sends each attempt to the actor with the
  fewest calls in flight.

Weight sync: ``publish(version)`` puts the learner's weights into the object store once; every request to a
worker carries the reference of the newest weights and their version, and a worker fetches them only when
they are newer than its own, loading them between generate calls. The learner never waits on a worker.

Schedules are the runtime's: ``sequential`` (η = 0 or ``deterministic``) splits a step's groups over the
workers and waits for them; with one worker the run's own generator state travels with the request and
back, so the samples equal the in-process backend's bit for bit. ``concurrent`` keeps every worker busy
with groups the staleness gate admits.

Faults (``unipg.runtime.backends.ray_faults``). A worker that dies (a crash, ``ray.kill``, a lost machine) or holds
a group past ``ray.episode_timeout`` is killed and replaced; its groups are run again (``re-queued``) on any worker,
with their admission version kept, up to ``ray.max_attempts`` runs, after which a group is counted as
failed and its admission slot given back. An environment actor on which a call timed out is asked to
abandon the call; if the call's thread cannot be stopped (a hung synchronous tool) or the actor does not
answer within ``ray.health_timeout``, it is restarted by Ray, and the calls it held fail and are retried by
the service. Episode accounting (``rollout/episodes_*``, cumulative) always balances:
started = finished + failed + re-queued + in flight. A run that cannot go on (workers keep dying past
``ray.max_restarts``, an actor cannot be started within ``ray.start_timeout``) stops with an error that
says so; the driver keeps its checkpoints. Every remote wait has a timeout.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque

import torch

from unipg.config import Config
from unipg.envs.service import ServiceStats
from unipg.learn.state import generator_state, restore_generator
from unipg.policy.adapters import synced_state
from unipg.runtime.backends.local_lm import split_groups

# ray_actors says how to install Ray if it is missing; connect is imported here, where tests replace it
from unipg.runtime.backends.ray_actors import ray
from unipg.runtime.backends.ray_faults import WorkerFaults, _Job
from unipg.runtime.backends.ray_setup import (
    connect,
    disconnect,
    place,
    release,
    start_env_side,
    start_worker,
    wait_ready,
    worker_setup,
)
from unipg.runtime.driver import CountedEpisodes, EpisodeAccount, RolloutReport
from unipg.runtime.replay import Group, ReplayBuffer, StalenessGate
from unipg.sample.endpoint_agents import AgentStats
from unipg.sample.episodes import EpisodeRunner


class RayRollout(WorkerFaults, CountedEpisodes):
    """The ``Rollout`` of ``unipg.runtime.driver`` on Ray actors (module docstring)."""

    def __init__(self, runner: EpisodeRunner, sampler, config: Config, generator: torch.Generator, task, log=print):
        self.config, self.sampler, self.generator, self.log = config, sampler, generator, log
        self.settings = settings = config.ray
        self.source = runner.policy.model
        self.uses_tools = runner.service is not None
        self.group_size = config.sample.samples_per_prompt
        self.roles = max(len(runner.roles), 1)  # trajectories per episode
        self.account = EpisodeAccount()
        self.worker_restarts = 0
        self.lost_on: dict[int, dict] = {}
        self.service = ServiceStats()
        self.agent = AgentStats() if runner.external is not None else None  # an external agent's counters
        self.env_restarts = 0
        self.batch_sizes: list[int] = []
        self.generate_seconds = self.sync_seconds = self.idle_seconds = 0.0
        self.weights: tuple[int, int, list] | None = None  # (publication serial, version, [object ref])
        self.load: list[int] = []  # the concurrent schedule's groups in flight per worker
        self._lock = threading.Lock()
        self.workers, self.env_actors, self.placement = [], [], None
        self.worker_names: list[str] = []  # each worker's actor name
        self._where: list = []  # each worker's answer to ``ready`` (where it runs): a reference, once fetched a dict
        self.run_id = uuid.uuid4().hex[:8]  # actor names: unipg-rollout-<run>-<index>.<replacement>
        self.connected = connect(settings)  # this run connected, and disconnects (stopping a local instance)
        self.local = self.connected and settings.address is None
        try:
            start_env_side(config, runner, self.run_id, self.env_actors, local=self.local, log=log)
            if settings.placement != "none":
                self.placement = place(settings)
            self._setup = ray.put(worker_setup(config, runner, task))
            for i in range(settings.rollout_workers):
                self.workers.append(self._start_worker(i))
            names = [f"rollout worker {i} ({name})" for i, name in enumerate(self.worker_names)]
            self._where = wait_ready(self._where, names, settings.start_timeout)
        except BaseException:
            self.close()
            raise

    def _start_worker(self, index: int):
        name = f"unipg-rollout-{self.run_id}-{index}.{self.worker_restarts}"
        worker = start_worker(self.settings, self._setup, index, self.env_actors, self.placement, name=name)
        where = worker.ready.remote()
        if index < len(self.worker_names):  # a replacement
            self.worker_names[index], self._where[index] = name, where
        else:
            self.worker_names.append(name)
            self._where.append(where)
        return worker

    def placed(self, index: int) -> dict | None:
        """Where rollout worker ``index`` runs (``RolloutWorker.ready``: its Ray node's id and address, its
        process), once it has said so; None before, or if it died first."""
        where = self._where[index]
        if not isinstance(where, dict):
            answered, _ = ray.wait([where], timeout=0)
            try:
                self._where[index] = where = ray.get(answered[0], timeout=0) if answered else where
            except Exception:  # noqa: BLE001 — it died before it answered: nothing to say where it was
                return None
        return where if isinstance(where, dict) else None

    def describe_worker(self, index: int) -> str:
        """Rollout worker ``index`` as an error names it: its index, actor name and, once known, where it runs."""
        where = self.placed(index)
        node = f", node {where['node_id'][:12]} at {where['node_ip']}, pid {where['pid']}" if where else ""
        return f"rollout worker {index} (actor {self.worker_names[index]}{node})"

    @property
    def groups_per_worker(self) -> int:
        """Groups one worker runs at once (``ray.episodes_per_worker``, default ``agent.concurrency``)."""
        return max((self.settings.episodes_per_worker or self.config.agent.concurrency) // self.group_size, 1)

    # -- the Rollout protocol ----------------------------------------------------------------------------

    def publish(self, version: int) -> None:
        """Put the learner's weights into the object store once; workers fetch them when they need them."""
        start = time.perf_counter()
        state = {name: tensor.cpu() for name, tensor in synced_state(self.source).items()}  # LoRA: the adapter
        ref = ray.put(state)  # copies into the object store now: later optimizer steps do not reach it
        with self._lock:
            serial = self.weights[0] + 1 if self.weights is not None else 1
            self.weights = (serial, version, [ref])
        self.sync_seconds += time.perf_counter() - start

    def produce(self, count: int, version: int) -> list[Group]:
        """``count`` groups with the current weights: the step's episodes split over the workers."""
        examples = [example for example in self.sampler.next(count) for _ in range(self.group_size)]
        shards = min(len(self.workers), count)
        cuts = [round(i * count / shards) * self.group_size for i in range(shards + 1)]
        if shards == 1:
            states = [generator_state(self.generator)]
        else:
            seeds = torch.randint(2**62, (shards,), generator=self.generator).tolist()
            states = [generator_state(torch.Generator().manual_seed(seed)) for seed in seeds]
        jobs = [
            _Job(examples[cuts[i] : cuts[i + 1]], version, cuts[i + 1] - cuts[i], order=i, state=states[i])
            for i in range(shards)
        ]
        inflight = {self._submit(job, job.order): job for job in jobs}
        results: dict[int, list] = {}
        try:
            while inflight:
                ready, _ = ray.wait(list(inflight), num_returns=1, timeout=1.0)
                for ref in ready:
                    job = inflight.pop(ref)
                    outcome = self._collect(ref, job)
                    if outcome is None:  # lost with its worker: run it again (same generator state, same samples)
                        self._give_up_or_keep(job, sequential=True)
                        inflight[self._submit(job, job.worker)] = job
                        continue
                    trajectories, state, report = outcome
                    results[job.order] = trajectories
                    self._absorb(report, job.worker, job.size)
                    if shards == 1:
                        restore_generator(self.generator, state)
                self._time_out(inflight)
        finally:
            self._cancel(inflight)
        trajectories = [t for order in range(shards) for t in results[order]]
        return split_groups(trajectories, version, self.group_size, self.roles)

    def serve(self, gate: StalenessGate, buffer: ReplayBuffer, stop: threading.Event) -> None:
        """Keep every worker busy with the groups the gate admits; write each finished group to the buffer."""
        per_worker = self.groups_per_worker
        inflight: dict[object, _Job] = {}
        queue: deque[_Job] = deque()  # groups to run again
        self.load = load = [0] * len(self.workers)  # groups in flight per worker
        order = 0
        idle_since = time.perf_counter()
        try:
            while not stop.is_set():
                free = per_worker * len(self.workers) - len(inflight)
                while queue and free:
                    job = queue.popleft()
                    worker = min(range(len(load)), key=load.__getitem__)
                    inflight[self._submit(job, worker)] = job
                    load[worker] += 1
                    free -= 1
                if free > 0:
                    admitted = gate.admit(self.group_size, timeout=0.005 if inflight else 0.05, most=free)
                    if admitted is not None:
                        version, count = admitted
                        if not inflight:
                            with self._lock:
                                self.idle_seconds += time.perf_counter() - idle_since
                        for example in self.sampler.next(count):
                            worker = min(range(len(load)), key=load.__getitem__)
                            job = _Job([example], version, self.group_size, order=order)
                            order += 1
                            inflight[self._submit(job, worker)] = job
                            load[worker] += 1
                if not inflight:
                    continue
                ready, _ = ray.wait(list(inflight), num_returns=len(inflight), timeout=0.02)
                for ref in ready:
                    job = inflight.pop(ref)
                    load[job.worker] -= 1
                    outcome = self._collect(ref, job)
                    if outcome is None:
                        if self._give_up_or_keep(job, sequential=False):
                            queue.append(job)
                        else:
                            gate.release(job.size)
                            buffer.forget(job.version)
                        continue
                    trajectories, report = outcome
                    self._absorb(report, job.worker, job.size)
                    buffer.put(Group(trajectories, job.version, job.size))
                if not inflight:
                    idle_since = time.perf_counter()
                self._time_out(inflight)
        finally:
            self._cancel(inflight)

    def _cancel(self, inflight: dict) -> None:
        """Rollout stops (the run ends, rolls back, or failed): cancel what is still running, and count it."""
        for ref in inflight:
            ray.cancel(ref)
        with self._lock:
            lost = sum(job.size for job in inflight.values())
            self.account.cancelled += lost
            self.account.in_flight -= lost

    # -- requests (a lost one: WorkerFaults, ray_faults.py) ----------------------------------------------

    def _submit(self, job: _Job, worker: int):
        job.worker, job.handle, job.since = worker, self.workers[worker], time.monotonic()
        job.attempts += 1
        with self._lock:
            self.account.started += job.size
            self.account.in_flight += job.size
        if job.state is not None:
            return job.handle.run_batch.remote(job.examples, job.version, self.weights, job.state)
        return job.handle.run_group.remote(job.examples[0], job.order, self.weights)

    # -- reporting ---------------------------------------------------------------------------------------

    def _absorb(self, report: dict, worker: int, episodes: int) -> None:
        with self._lock:
            self.account.finished += episodes
            self.account.in_flight -= episodes
            self.env_restarts += report["env_restarts"]
            self.batch_sizes += report["sizes"]
            self.generate_seconds += report["seconds"]
            if report["service"] is not None:
                self.service.merge(report["service"])
            if report["agent"] is not None:
                self.agent.merge(report["agent"])

    def report(self) -> RolloutReport:
        """Since the last report: the workers' generate calls (reported with their results), the seconds the
        concurrent schedule had no group in flight, the seconds spent putting weights into the object store, the
        workers' environment service (and external agent) counters and the worker and actor restarts; and the
        episode counts."""
        with self._lock:
            sizes, seconds, idle = self.batch_sizes, self.generate_seconds, self.idle_seconds
            self.batch_sizes, self.generate_seconds, self.idle_seconds = [], 0.0, 0.0
            stats, self.service = self.service, ServiceStats()
            counters = stats.metrics("rollout") if self.uses_tools else {}
            if self.agent is not None:
                counters.update(self.agent.pop().metrics("rollout"))
            counters["ray/worker_restarts"] = float(self.worker_restarts)
            if self.env_actors:
                counters["ray/env_restarts"] = float(self.env_restarts)
            episodes = EpisodeAccount(**self.account.state())
        sync, self.sync_seconds = self.sync_seconds, 0.0
        return RolloutReport(sizes, seconds, idle, sync, counters, episodes)

    # -- shutdown ----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every actor of the run (and the local Ray instance, if the run started it), once the rollout workers
        stopped what they serve (an external agent's endpoint) or ``ray.health_timeout`` passed."""
        closing = [worker.close.remote() for worker in self.workers]
        if closing:
            ray.wait(closing, num_returns=len(closing), timeout=self.settings.health_timeout)
        release([*self.workers, *self.env_actors], self.placement)
        self.workers, self.env_actors, self.placement = [], [], None
        if self.connected:
            disconnect()
            self.connected = False
