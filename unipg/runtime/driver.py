"""The rollout/learner runtime: one driver for synchronous and asynchronous training.

The driver (``unipg.runtime.lm``, ``unipg.runtime.gym``) asks ``Runtime.next_groups(version)`` for the groups
of its next learner step, trains on them, and calls ``Runtime.publish(version + 1)``. Between the two sit
the ``StalenessGate`` and the ``ReplayBuffer`` of ``unipg.runtime.replay``; what produces groups is a
``Rollout``:

- ``Rollout.produce(count, version)`` runs ``count`` groups to the end with the current weights, now;
- ``Rollout.serve(gate, buffer, stop)`` runs groups without end in a background thread, starting each one
  when the gate admits it and writing it to the buffer when it finishes;
- ``Rollout.publish(version)`` makes the learner's new weights available to the rollout side.

Two schedules (``runtime.schedule``):

- ``sequential``: before each learner step the driver fills the gate's room by calling ``produce`` on its
  own thread; rollout and learner never overlap, so every figure is reproducible. With
  ``max_staleness = 0`` this is synchronous training, the learner step consuming data of the weights it
  starts from. With ``max_staleness = η > 0`` the first fill produces η + 1 steps' worth of groups and each
  step after one more, so (with ``fifo`` sampling) every step trains on data exactly η versions old:
  the controlled staleness of an ablation.
- ``concurrent``: rollout runs in a background thread (``serve``) on its own copy of the weights, synced by
  version, while the learner trains in the caller's thread (a ``breakpoint()`` in the learner works). Slow
  tools and long episodes no longer hold up the learner, which waits only when the buffer lacks data.

``auto`` is ``sequential`` when ``max_staleness = 0`` (the schedules do the same thing then) or when
``deterministic`` is set, else ``concurrent``.

The concurrent schedule's learner waits at most ``runtime.rollout_timeout`` seconds without a group written
(``rollout_stuck``); ``close`` then leaves the stuck rollout thread behind, a daemon.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from unipg.policy.adapters import load_synced_state, synced_state
from unipg.runtime.replay import (
    BufferStats,
    Group,
    ProducerFailed,
    ReplayBuffer,
    StalenessGate,
    rollout_failure,
    rollout_stuck,
)


@dataclass
class EpisodeAccount:
    """Cumulative episode counts of a run's rollout, each counted where it happens; they balance:
    started = finished + failed + requeued + cancelled + in_flight."""

    started: int = 0
    finished: int = 0
    failed: int = 0  # ended by an error of the episode, or given up after too many lost runs (Ray)
    requeued: int = 0  # runs interrupted (a task cancelled, a worker lost) and started again
    cancelled: int = 0  # in flight when rollout stopped (a rollback or the end of the run)
    in_flight: int = 0  # running now

    def metrics(self) -> dict[str, float]:
        return {
            f"rollout/episodes_{name}": float(getattr(self, name))
            for name in ("started", "finished", "failed", "requeued", "cancelled", "in_flight")
        }

    def state(self) -> dict[str, int]:
        """The counts, for a checkpoint."""
        return dict(vars(self))

    def resume(self, state: dict[str, int] | None) -> None:
        """Continue the counts of a checkpoint (a resumed run); what was in flight then was lost with its
        process, so it counts as cancelled."""
        if not state:
            return
        for name, value in state.items():
            setattr(self, name, int(value))
        self.cancelled, self.in_flight = self.cancelled + self.in_flight, 0


@dataclass
class RolloutReport:
    """What a rollout did since its previous report (``Rollout.report``); the runtime takes one per learner step."""

    batch_sizes: list[int] = field(default_factory=list)  # sequences in each generate call
    generate_seconds: float = 0.0  # seconds spent in those generate calls
    idle_seconds: float = 0.0  # concurrent schedule: seconds in which the rollout ran nothing
    sync_seconds: float | None = None  # seconds spent publishing and loading weights (None: no weight sync)
    counters: dict[str, float] = field(default_factory=dict)  # environment service, engine, external agent and
    # Ray counters, under the names they are logged with (``rollout/tool_*``, ``engine/*``, ``ray/*``)
    episodes: EpisodeAccount | None = None  # the cumulative episode counts, a copy (None: the rollout keeps none)

    def metrics(self) -> dict[str, float]:
        """The counters, the episode counts and ``timing/weight_sync``, as logged."""
        metrics = dict(self.counters)
        if self.episodes is not None:
            metrics.update(self.episodes.metrics())
        if self.sync_seconds is not None:
            metrics["timing/weight_sync"] = self.sync_seconds
        return metrics


class Rollout(Protocol):
    """What produces groups for ``Runtime``, and everything the drivers ask of it.

    The backends (``GymSegments``, ``LMRollout``, ``RayRollout``) implement every member.
    ``tests/runtime/test_rollout_protocol.py`` checks that each backend has every member with the same parameters.
    """

    # -- producing groups (``Runtime``) --------------------------------------------------------------------

    def produce(self, count: int, version: int) -> list[Group]:
        """Run ``count`` groups to the end now, with the weights of ``version`` (sequential schedule)."""
        ...

    def serve(self, gate: StalenessGate, buffer: ReplayBuffer, stop: threading.Event) -> None:
        """Run the groups ``gate`` admits into ``buffer`` until ``stop`` is set (concurrent schedule's thread)."""
        ...

    def publish(self, version: int) -> None:
        """Make the learner's weights of ``version`` available to the rollout side."""
        ...

    def report(self) -> RolloutReport:
        """What the rollout did since the last report (``Runtime.next_groups`` takes one per learner step); a field
        the rollout has nothing for keeps its default."""
        ...

    # -- checkpoints and shutdown ----------------------------------------------------------------------

    def resume_episodes(self, state: dict[str, int] | None) -> None:
        """Continue the episode counts a checkpoint saved (``RolloutReport.episodes``) in a resumed run."""
        ...

    def close(self) -> None:
        """Release what the rollout owns (its own runner, Ray actors); after ``Runtime.close``."""
        ...


class CountedEpisodes:
    """The episode bookkeeping of a rollout that counts its episodes in ``account`` under ``_lock``."""

    account: EpisodeAccount
    _lock: threading.Lock

    def counted_episodes(self) -> EpisodeAccount:
        """A copy of the episode counts, consistent (read under the lock the rollout counts under)."""
        with self._lock:
            return EpisodeAccount(**self.account.state())

    def resume_episodes(self, state: dict[str, int] | None) -> None:
        """Continue the episode counts of a checkpoint (``EpisodeAccount.resume``)."""
        with self._lock:
            self.account.resume(state)


def serve_one_by_one(
    rollout: Rollout, gate: StalenessGate, buffer: ReplayBuffer, stop: threading.Event, group_size: int
) -> None:
    """``serve`` for a rollout without inner concurrency: produce admitted groups one at a time."""
    while not stop.is_set():
        admitted = gate.admit(group_size, timeout=0.1)
        if admitted is None:
            continue
        for group in rollout.produce(1, admitted[0]):
            buffer.put(group)


class WeightSync:
    """Copies a learner's weights into the rollout side's model, by version.

    ``publish`` (learner thread) snapshots the parameters and buffers (with LoRA, the adapter's only); ``pull`` (rollout thread, between
    generation batches) loads the newest snapshot if it has not been loaded yet.
    """

    def __init__(self, source: torch.nn.Module, target: torch.nn.Module):
        self.source, self.target = source, target
        self.version, self._serial, self._loaded = 0, 0, 0  # serial: publications, even of an older version
        self.publish_seconds, self.pull_seconds = 0.0, 0.0
        self._state: dict[str, torch.Tensor] | None = None
        self._lock = threading.Lock()

    def publish(self, version: int) -> None:
        start = time.perf_counter()
        with torch.no_grad():
            state = {name: tensor.clone() for name, tensor in synced_state(self.source).items()}
        with self._lock:
            self._state, self.version, self._serial = state, version, self._serial + 1
        self.publish_seconds += time.perf_counter() - start

    def pull(self) -> int | None:
        """Load the newest published weights; returns their version, or None if already loaded."""
        with self._lock:
            if self._state is None or self._serial == self._loaded:
                return None
            state, version, serial = self._state, self.version, self._serial
        start = time.perf_counter()
        load_synced_state(self.target, state)
        self._loaded = serial
        self.pull_seconds += time.perf_counter() - start
        return version

    def pop_seconds(self) -> float:
        seconds = self.publish_seconds + self.pull_seconds
        self.publish_seconds = self.pull_seconds = 0.0
        return seconds


@dataclass
class StepReport:
    """The runtime's account of one learner period: from the previous ``next_groups`` to the return of this one."""

    learner_wait: float  # seconds the learner waited for the step's groups (sequential schedule: producing them)
    learner_idle_fraction: float  # that wait over the whole period
    rollout_idle_fraction: float  # share of the period in which rollout ran nothing
    buffer_trajectories: int  # trajectories the buffer held before the step's groups were taken
    buffer_occupancy: float  # those over the buffer's capacity
    buffer: BufferStats  # trajectories evicted, dropped as stale and filtered in the period
    ages: list[int]  # each taken group's staleness: learner versions between its weights and the step's
    rollout: RolloutReport  # what the rollout reported for the period

    def metrics(self) -> dict[str, float]:
        """The runtime's metrics of the period (``timing/*`` and ``async/*``; the rollout's are its report's)."""
        return {
            "timing/learner_idle_fraction": self.learner_idle_fraction,
            "timing/learner_wait": self.learner_wait,
            "timing/rollout_idle_fraction": self.rollout_idle_fraction,
            "async/buffer_occupancy": self.buffer_occupancy,
            "async/buffer_trajectories": self.buffer_trajectories,
            "async/evicted": self.buffer.evicted,
            "async/dropped_stale": self.buffer.dropped_stale,
            "async/filtered": self.buffer.filtered,
            "async/staleness_trajectory_mean": sum(self.ages) / len(self.ages),
            "async/staleness_trajectory_max": max(self.ages),
        }


def resolve_schedule(schedule: str, max_staleness: int, deterministic: bool) -> str:
    if schedule != "auto":
        return schedule
    return "sequential" if max_staleness == 0 or deterministic else "concurrent"


class Runtime:
    """Admission gate + replay buffer + rollout, scheduled sequentially or concurrently (module docstring)."""

    def __init__(
        self,
        rollout: Rollout,
        *,
        groups_per_step: int,
        group_size: int,
        max_staleness: int,
        capacity: int,
        schedule: str = "sequential",
        sampling: str = "fifo",
        eviction: str = "oldest",
        freshness_decay: float = 0.5,
        seed: int = 0,
        on_settled: Callable[[list[Group]], None] | None = None,
        keep: Callable[[Group], bool] | None = None,
        filter_budget: int = 0,
        rollout_timeout: float | None = None,
    ):
        """``on_settled`` is told of the groups that will not be trained on later: those each step takes, and
        those the buffer drops (the prompt sampler's bookkeeping for exact resumes). ``keep`` and
        ``filter_budget``: the buffer's test on written groups and its bound per step (dynamic sampling;
        ``ReplayBuffer``). ``rollout_timeout``: seconds the learner waits for a group of the concurrent schedule's
        rollout (None: for ever; module docstring)."""
        if schedule not in ("sequential", "concurrent"):
            raise ValueError(f"runtime schedule '{schedule}' is not known; use sequential or concurrent")
        per_step = groups_per_step * group_size
        if capacity < per_step:
            raise ValueError(
                f"sample.replay_buffer_size ({capacity}) cannot hold one learner step's batch of {per_step} "
                f"trajectories; set it to at least {(max_staleness + 1) * per_step} "
                "((runtime.max_staleness + 1) batches, so that nothing admitted is evicted)"
            )
        self.rollout, self.schedule, self.rollout_timeout = rollout, schedule, rollout_timeout
        self.groups_per_step, self.group_size, self.max_staleness = groups_per_step, group_size, max_staleness
        self.on_settled = on_settled or (lambda groups: None)
        self.buffer = ReplayBuffer(
            capacity,
            max_staleness=max_staleness,
            sampling=sampling,
            eviction=eviction,
            freshness_decay=freshness_decay,
            seed=seed,
            on_discard=self.on_settled,
            keep=keep,
            filter_budget=filter_budget,
        )
        self.gate = StalenessGate(max_staleness, per_step, on_admit=self.buffer.expect)
        self.buffer.on_drop = self.gate.release
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stuck = False  # the rollout thread wrote no group within rollout_timeout
        self._since = time.perf_counter()  # start of the current learner period (wait + train)

    @property
    def concurrent(self) -> bool:
        return self.schedule == "concurrent"

    def start(self) -> Runtime:
        self._since = time.perf_counter()
        if self.concurrent and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._serve, name="unipg-rollout", daemon=True)
            self._thread.start()
        return self

    def _serve(self) -> None:
        try:
            self.rollout.serve(self.gate, self.buffer, self._stop)
        except BaseException as error:  # noqa: BLE001 — reported to the learner by the buffer
            self.buffer.fail(error)

    def next_groups(self, version: int, count: int | None = None) -> tuple[list[Group], StepReport]:
        """The groups of the learner step that starts from ``version``, and the report of the period since the
        previous call (waiting, occupancy, drops, staleness of the groups returned, the rollout's report).
        ``count``: groups to take (default ``groups_per_step``); the rest of the step's batch comes from
        elsewhere (offline data), and rollout starts that many fewer."""
        wait_start = time.perf_counter()
        produced = 0.0
        wanted = self.groups_per_step if count is None else count
        if wanted < self.groups_per_step:
            self.gate.credit((self.groups_per_step - wanted) * self.group_size)
        if not self.concurrent:
            # Fill the room; groups the buffer's test rejects give theirs back and are replaced, until a round
            # rejects none (the test's budget bounds the rounds). Room given back by eviction is not refilled.
            while fill := self.gate.room() // self.group_size:
                rejected = self.buffer.stats.filtered
                started = self.gate.take_room(fill * self.group_size)
                try:
                    groups = self.rollout.produce(fill, started)
                except Exception as error:  # as the concurrent schedule reports it: the driver keeps what it has
                    raise ProducerFailed(rollout_failure(error)) from error
                for group in groups:
                    self.buffer.put(group)
                if self.buffer.stats.filtered == rejected:
                    break
            produced = time.perf_counter() - wait_start
        occupancy = len(self.buffer)
        groups = self.buffer.take(wanted, version, timeout=self.rollout_timeout if self.concurrent else None)
        if groups is None:
            self._stuck = True
            raise rollout_stuck(self._thread.name, version, self.rollout_timeout)
        self.on_settled(groups)
        now = time.perf_counter()
        waited, period = now - wait_start, max(now - self._since, 1e-9)
        self._since = now
        stats, rollout = self.buffer.pop_stats(), self.rollout.report()
        # the sequential schedule's rollout runs only while the learner waits for it
        rollout_idle = rollout.idle_seconds if self.concurrent else period - produced
        return groups, StepReport(
            learner_wait=waited,
            learner_idle_fraction=waited / period,
            rollout_idle_fraction=min(max(rollout_idle / period, 0.0), 1.0),
            buffer_trajectories=occupancy,
            buffer_occupancy=occupancy / self.buffer.capacity,
            buffer=stats,
            ages=[group.age(version) for group in groups],
            rollout=rollout,
        )

    def publish(self, version: int) -> None:
        """The learner finished the step that produced ``version``: sync weights, admit new rollouts."""
        self.rollout.publish(version)
        self.gate.publish(version)

    def reset(self, version: int) -> None:
        """Forget everything buffered or in flight and continue from ``version`` (after a rollback)."""
        self.close()
        self.buffer.clear()
        self.buffer.pop_stats()
        self.gate.reset(version)
        self.rollout.publish(version)
        self.start()

    def close(self) -> None:
        """Stop the rollout thread; wait for it at most ``rollout_timeout`` (not once it is stuck), then leave it."""
        self._stop.set()
        self.gate.close()
        if self._thread is not None:
            self._thread.join(0.0 if self._stuck else self.rollout_timeout)
            if self._thread.is_alive():
                print(f"warning: the rollout thread ({self._thread.name}) did not stop; left behind", file=sys.stderr)
            self._thread = None

    def __enter__(self) -> Runtime:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()
