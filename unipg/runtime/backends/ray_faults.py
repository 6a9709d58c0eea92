"""What the Ray rollout (``unipg.runtime.backends.ray_lm``) does when a request is lost: a rollout worker that died or
held a request past ``ray.episode_timeout`` is killed and replaced, up to ``ray.max_restarts``; a lost request runs
again up to ``ray.max_attempts`` times, and is then counted as failed (``RolloutFailed`` when rollout cannot go on).
A worker lost with its node is replaced only while a live node has, in all, what a worker asks for; otherwise rollout
stops, naming the node, and a replacement that does not start within ``ray.start_timeout`` counts as lost."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ray.exceptions import GetTimeoutError, RayTaskError, TaskCancelledError

from unipg.runtime.backends.ray_actors import LOST, ray
from unipg.runtime.backends.ray_setup import LOST_ACTOR_HINT, last_line, rollout_bundle
from unipg.runtime.driver import EpisodeAccount
from unipg.runtime.replay import ProducerFailed

if TYPE_CHECKING:
    from collections.abc import Callable

    from unipg.config.run import RayConfig


@dataclass
class _Job:
    """One request of the Ray rollout: a group (concurrent schedule) or a shard of a step (sequential), with what
    its retries need."""

    examples: list  # the group's example (concurrent) or a shard of a step's episodes (sequential)
    version: int  # the learner version that admitted it
    size: int  # episodes
    order: int = 0
    state: str | None = None  # sequential: the generator state the shard samples with
    attempts: int = 0
    worker: int = -1
    handle: object = None
    since: float = field(default_factory=time.monotonic)


def survivors_of_lost(where: dict | None) -> list[dict] | None:
    """The cluster's live nodes (``ray.nodes``) if the node of ``where`` (a worker's ``ready`` answer) has died,
    else None (alive, or not known)."""
    if where is None:
        return None
    nodes = ray.nodes()
    if any(node["NodeID"] == where["node_id"] and node["Alive"] for node in nodes):
        return None
    return [node for node in nodes if node["Alive"]]


def hosts(node: dict, bundle: dict[str, float]) -> bool:
    """Whether ``node`` (an entry of ``ray.nodes``) has, in all, what ``bundle`` asks for."""
    return all(node["Resources"].get(name, 0.0) >= amount for name, amount in bundle.items() if amount)


class RolloutFailed(ProducerFailed):
    """Rollout on Ray cannot go on: workers keep dying, or a step's episodes keep being lost."""


class WorkerFaults:
    """The fault handling of ``RayRollout``: it counts episodes in ``account`` under ``_lock``, keeps its workers in
    ``workers`` and starts a worker with ``_start_worker``."""

    settings: RayConfig
    workers: list
    account: EpisodeAccount
    worker_restarts: int
    groups_per_worker: int
    group_size: int
    lost_on: dict[int, dict]  # where each replaced worker's forerunner ran (``placed``), until its successor says
    _lock: threading.Lock
    log: Callable[[str], None]
    describe_worker: Callable[[int], str]
    placed: Callable[[int], dict | None]

    def _collect(self, ref, job: _Job):
        """The result of a finished request, or None if it was lost with its worker (which is replaced)."""
        try:
            return ray.get(ref, timeout=self.settings.start_timeout)
        except (*LOST, TaskCancelledError, GetTimeoutError) as error:
            lost = error
        except RayTaskError as error:
            cause = error.cause
            if not isinstance(cause, (TimeoutError, *LOST)):  # the episode code itself raised
                self._count_failed(job)
                raise RolloutFailed(
                    f"an episode raised on rollout worker {job.worker}: {type(cause).__name__}: "
                    f"{str(cause).splitlines()[0] if str(cause) else ''}"
                ) from error
            lost = cause  # the worker could not fetch its weights or inputs in time: replace it
        try:
            self._replace(job.worker, job.handle, lost)
        except RolloutFailed:
            self._count_failed(job)
            raise
        return None

    def _count_failed(self, job: _Job) -> None:
        with self._lock:
            self.account.in_flight -= job.size
            self.account.failed += job.size

    def _give_up_or_keep(self, job: _Job, *, sequential: bool) -> bool:
        """Count a lost run; whether the job runs again (False: given up and counted as failed)."""
        with self._lock:
            self.account.in_flight -= job.size
            if job.attempts < self.settings.max_attempts:
                self.account.requeued += job.size
                return True
            self.account.failed += job.size
        if sequential:
            raise RolloutFailed(
                f"a rollout shard of {job.size} episodes was lost {job.attempts} times "
                "(ray.max_attempts); "
                "the workers running it keep dying — see the Ray logs (/tmp/ray/session_latest/logs)"
            )
        self.log(
            f"warning: a group of {job.size} episodes was lost {job.attempts} times (ray.max_attempts); "
            "counted as failed (rollout/episodes_failed)"
        )
        return False

    def _replace(self, index: int, handle, error: BaseException) -> None:
        if self.workers[index] is not handle:
            return  # replaced already, for another of its requests
        self.worker_restarts += 1
        worker = self.describe_worker(index)
        where = self.placed(index) or self.lost_on.get(index)  # a replacement that never started: its forerunner's
        survivors = survivors_of_lost(where)
        if survivors is not None and not any(hosts(node, rollout_bundle(self.settings)) for node in survivors):
            raise RolloutFailed(
                f"{worker} was lost with its node {where['node_id'][:12]} at {where['node_ip']}, which died "
                f"({type(error).__name__}), and no node left in the cluster has what a rollout worker asks for "
                f"({rollout_bundle(self.settings)}): start one that has it (`ray start --address=HEAD:PORT` with "
                "--num-cpus/--num-gpus/--resources) or change ray.rollout_num_cpus / rollout_num_gpus / "
                "rollout_resources, then resume"
            )
        if self.worker_restarts > self.settings.max_restarts:
            times = f"{self.worker_restarts} time{'s' if self.worker_restarts > 1 else ''}"
            raise RolloutFailed(
                f"{worker} was lost ({type(error).__name__}: {last_line(error)}); rollout workers died or hung "
                f"{times}, more than ray.max_restarts={self.settings.max_restarts}: {LOST_ACTOR_HINT}"
            )
        ray.kill(handle, no_restart=True)
        died = f" with its node {where['node_id'][:12]}, which died" if survivors is not None else ""
        self.log(
            f"warning: {worker} lost{died} ({type(error).__name__}); started a new one "
            f"({self.worker_restarts} of ray.max_restarts={self.settings.max_restarts}); its episodes run again"
        )
        if where is not None:
            self.lost_on[index] = where
        self.workers[index] = self._start_worker(index)

    def _time_out(self, inflight: dict) -> None:
        """Kill the workers of requests past ``ray.episode_timeout``, and replacements that did not start within
        ``ray.start_timeout`` (no node can host them now); their requests come back as lost."""
        now = time.monotonic()
        for job in inflight.values():
            if (
                now - job.since > self.settings.start_timeout
                and self.workers[job.worker] is job.handle
                and self.placed(job.worker) is None
            ):
                self.log(
                    f"warning: {self.describe_worker(job.worker)} did not start within "
                    f"ray.start_timeout={self.settings.start_timeout:g} s; killing it"
                )
                ray.kill(job.handle, no_restart=True)
                job.since = now
                continue
            waves = -(-job.size // (self.groups_per_worker * self.group_size))  # a shard of many groups runs in waves
            if now - job.since > self.settings.episode_timeout * waves and self.workers[job.worker] is job.handle:
                self.log(
                    f"warning: {self.describe_worker(job.worker)} held a request for {now - job.since:.0f} s, past "
                    f"ray.episode_timeout={self.settings.episode_timeout:g} s; killing it"
                )
                ray.kill(job.handle, no_restart=True)
                job.since = now  # reported once; the kill makes the request finish as lost
