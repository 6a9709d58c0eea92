"""The replay buffer between rollout and learner, and the admission gate that bounds staleness.

Rollout writes whole groups (a GRPO group of ``samples_per_prompt`` episodes of one prompt, or one rollout
segment of a gym run); the learner takes whole groups, so a group is never split. Every group carries the
policy version that started it and the time it was written.

Staleness is bounded where it is cheapest and least biased: at admission. ``StalenessGate`` lets rollout
start a new group only while the trajectories started so far fit in ``(version + max_staleness + 1)``
learner steps' worth, the rule AReaL calls ``max_head_offpolicyness``. The buffer completes the bound on
the learner's side. A group started at version v is *due* at learner version v + η: the step at version k
takes every due group, and also enough of the oldest groups that none can fall due later than its step —
for every h ≤ η, the groups started at k + h − η or before that remain after this step must fit in the h
steps before they fall due. It waits for running groups only when that requires them. So a long, slow
episode is never dropped for being slow — which would bias the data toward easy, fast episodes — no
trajectory is trained on more than η versions after the weights that started it, and the learner does not
wait on a slow episode that can still be trained on later. With ``max_staleness = 0`` rollout for step k
starts only once step k − 1 is published, and the step waits for all of it: synchronous training.

Sampling preferences (``sampling``):

- ``fifo``: oldest first, the order the gate's bound is computed for;
- ``fresh``: newest first, which leaves old groups to eviction;
- ``weighted``: random without replacement, P(group) ∝ ``freshness_decay ** age``.

Eviction when a write would exceed ``capacity`` trajectories (``eviction``): ``oldest`` drops the oldest
groups, ``probabilistic`` drops groups at random with probability ∝ age + 1 (a buffer smaller than
``(max_staleness + 1)`` steps' worth of trajectories evicts). Groups found past the bound (left over after a
rollback) are dropped when the learner takes a batch. Every dropped group is counted and releases its
admission slots, so rollout replaces it. Sampling preferences apply to what the bound leaves free.

A ``keep`` test filters groups as they are written (dynamic sampling: a GRPO group whose episodes all scored
alike has zero advantage and teaches nothing). A group it rejects is not stored; like an evicted one it is
counted and releases its admission slots, so rollout samples another prompt in its place. ``filter_budget``
bounds the groups rejected between two learner steps (each costs a group of extra rollouts); past it, groups
are kept whatever the test says, so a step never waits on a test nothing passes.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from unipg.config.timeouts import WaitTimeout

SAMPLING = ("fifo", "fresh", "weighted")
EVICTION = ("oldest", "probabilistic")


@dataclass
class Group:
    """Trajectories that train together, stamped with the policy version that started them."""

    items: list[Any]  # trajectories (or one rollout segment)
    version: int  # the learner version whose weights started the group
    size: int  # trajectories it counts for, against capacity and admission
    created: float = field(default_factory=time.monotonic)

    def age(self, version: int) -> int:
        return version - self.version


class ProducerFailed(RuntimeError):
    """Rollout stopped with an error; raised on the learner's side so the run fails loudly."""


def rollout_failure(error: BaseException) -> str:
    """The one-line message of a rollout that died of ``error`` (a wait past its timeout says what and where itself)."""
    if isinstance(error, (ProducerFailed, WaitTimeout)):
        return str(error)
    first = str(error).splitlines()[0] if str(error) else ""
    return f"rollout failed: {type(error).__name__}: {first}" if first else f"rollout failed: {type(error).__name__}"


def rollout_stuck(thread: str, version: int, seconds: float) -> ProducerFailed:
    """The failure of a concurrent rollout whose ``thread`` wrote no group of the step from ``version`` for
    ``seconds`` (``runtime.rollout_timeout``), raised from a ``WaitTimeout``: the run ends as after a rollout error."""
    timeout = WaitTimeout.after(
        f"the rollout thread ({thread}) wrote no group of the step from version {version}",
        seconds,
        "runtime.rollout_timeout",
        "an episode or the inference engine may be stuck (sample.engine_timeout bounds the vllm engine's waits, "
        "agent.tool_timeout a tool's); raise runtime.rollout_timeout if a group of episodes needs longer",
    )
    failure = ProducerFailed(str(timeout))
    failure.__cause__ = timeout
    return failure


class StalenessGate:
    """Admission control: at most ``(version + max_staleness + 1) * per_step`` trajectories are ever started.

    ``version`` is the number of learner steps published; ``per_step`` the trajectories a learner step
    consumes. Trajectories dropped without training (``release``) give their slots back.
    """

    def __init__(self, max_staleness: int, per_step: int, on_admit: Callable[[int, int], None] | None = None):
        if max_staleness < 0:
            raise ValueError(f"max_staleness ({max_staleness}) must be ≥ 0; 0 is synchronous training")
        self.max_staleness, self.per_step = max_staleness, per_step
        self.version, self.started = 0, 0
        self.on_admit = on_admit or (lambda version, size: None)  # told (version, size) of every admission
        self._condition = threading.Condition()
        self._closed = False

    def room(self) -> int:
        """Trajectories that may be started now."""
        with self._condition:
            return self._room()

    def _room(self) -> int:
        return (self.version + self.max_staleness + 1) * self.per_step - self.started

    def admit(self, size: int, timeout: float | None = None, *, most: int = 1) -> tuple[int, int] | None:
        """Wait until a group of ``size`` trajectories may start, then admit as many such groups as fit, up to
        ``most``; returns (the version that starts them, how many), or None if the gate was closed or the wait
        timed out. Admitting together what fits together lets a batch of groups start in one go."""
        with self._condition:
            if not self._condition.wait_for(lambda: self._closed or self._room() >= size, timeout):
                return None
            if self._closed:
                return None
            count = min(self._room() // size, most)
            self.started += count * size
            for _ in range(count):
                self.on_admit(self.version, size)
            return self.version, count

    def take_room(self, size: int) -> int:
        """Count ``size`` trajectories started without waiting (the caller checked ``room``)."""
        with self._condition:
            if self._room() < size:
                raise RuntimeError(f"no room for {size} trajectories: {self._room()} may start now")
            self.started += size
            self.on_admit(self.version, size)
            return self.version

    def credit(self, size: int) -> None:
        """Count ``size`` trajectories a learner step takes from elsewhere (offline data) as started, so that
        rollout starts that many fewer."""
        with self._condition:
            self.started += size

    def publish(self, version: int) -> None:
        with self._condition:
            self.version = version
            self._condition.notify_all()

    def release(self, size: int) -> None:
        """``size`` started trajectories were dropped without training: rollout may replace them."""
        with self._condition:
            self.started -= size
            self._condition.notify_all()

    def reset(self, version: int) -> None:
        """Start counting afresh at ``version`` (after a rollback, nothing in flight)."""
        with self._condition:
            self.version, self.started, self._closed = version, version * self.per_step, False
            self._condition.notify_all()

    def close(self) -> None:
        with self._condition:
            self._closed = True
            self._condition.notify_all()


@dataclass
class BufferStats:
    """Counters since the last ``pop_stats``."""

    evicted: int = 0  # trajectories dropped to stay within capacity
    dropped_stale: int = 0  # trajectories dropped for exceeding the staleness bound
    filtered: int = 0  # trajectories of groups the ``keep`` test rejected
    taken: int = 0  # trajectories handed to the learner
    wait_seconds: float = 0.0  # time the learner waited for enough groups


class ReplayBuffer:
    """Bounded, thread-safe store of ``Group``s; see the module docstring for sampling and eviction."""

    def __init__(
        self,
        capacity: int,
        *,
        max_staleness: int | None = None,
        sampling: str = "fifo",
        eviction: str = "oldest",
        freshness_decay: float = 0.5,
        seed: int = 0,
        on_drop: Callable[[int], None] | None = None,
        on_discard: Callable[[list[Group]], None] | None = None,
        keep: Callable[[Group], bool] | None = None,
        filter_budget: int = 0,
    ):
        if capacity < 1:
            raise ValueError(f"replay buffer capacity ({capacity}) must be ≥ 1 trajectory")
        if sampling not in SAMPLING:
            raise ValueError(f"replay sampling '{sampling}' is not known; use one of {', '.join(SAMPLING)}")
        if eviction not in EVICTION:
            raise ValueError(f"replay eviction '{eviction}' is not known; use one of {', '.join(EVICTION)}")
        if not 0 < freshness_decay <= 1:
            raise ValueError(f"freshness_decay ({freshness_decay}) must be in (0, 1]; 1 samples uniformly")
        self.capacity, self.max_staleness = capacity, max_staleness
        self.sampling, self.eviction, self.freshness_decay = sampling, eviction, freshness_decay
        self.on_drop = on_drop or (lambda size: None)  # told the trajectories of the groups dropped
        self.on_discard = on_discard or (lambda groups: None)  # told the groups dropped themselves
        if filter_budget < 0:
            raise ValueError(f"filter_budget ({filter_budget}) must be ≥ 0 groups per learner step")
        self.keep, self.filter_budget = keep, filter_budget
        self._filter_left = filter_budget  # groups the test may still reject before the next ``take``
        self.random = random.Random(seed)
        self.groups: list[Group] = []  # in write order
        self.pending: dict[int, int] = {}  # groups admitted but not yet written, by start version
        self.stats = BufferStats()
        self._condition = threading.Condition()
        self._failure: BaseException | None = None
        self._version = 0  # the newest version seen, for ages at eviction time
        self._written = time.perf_counter()  # when a group was last written or forgotten: what a wait restarts at

    def __len__(self) -> int:
        """Trajectories held."""
        with self._condition:
            return sum(group.size for group in self.groups)

    def expect(self, version: int, size: int) -> None:
        """A group of ``size`` trajectories was admitted at ``version`` and will be written
        (``StalenessGate.on_admit``)."""
        with self._condition:
            self.pending[version] = self.pending.get(version, 0) + 1

    def forget(self, version: int) -> None:
        """A group admitted at ``version`` will never be written (it failed for good)."""
        with self._condition:
            self._unexpect(version)
            self._written = time.perf_counter()
            self._condition.notify_all()

    def _unexpect(self, version: int) -> None:
        if self.pending.get(version, 0) > 0:
            self.pending[version] -= 1
            if not self.pending[version]:
                del self.pending[version]

    def put(self, group: Group) -> None:
        if group.size > self.capacity:
            raise ValueError(
                f"a group of {group.size} trajectories cannot fit a replay buffer of {self.capacity}; "
                "raise sample.replay_buffer_size"
            )
        victims = []
        with self._condition:
            self._unexpect(group.version)
            self._written = time.perf_counter()
            if self.keep is not None and self._filter_left > 0 and not self.keep(group):
                self._filter_left -= 1
                self.stats.filtered += group.size
                victims.append(group)
            else:
                self.groups.append(group)
                held = sum(g.size for g in self.groups)
                while held > self.capacity:
                    victims.append(self._victim())
                    self.groups.remove(victims[-1])
                    held -= victims[-1].size
                self.stats.evicted += sum(g.size for g in victims)
            self._condition.notify_all()  # a step waiting on a rejected running group waits no more on it
        if victims:  # outside the lock: the gate's lock is taken in the other order on admission
            self.on_drop(sum(g.size for g in victims))
            self.on_discard(victims)

    def _victim(self) -> Group:
        if self.eviction == "oldest":
            return self.groups[0]
        newest = max(self._version, max(g.version for g in self.groups))
        weights = [newest - g.version + 1 for g in self.groups]
        return self.random.choices(self.groups, weights=weights)[0]

    def fail(self, error: BaseException) -> None:
        """Rollout died: wake the learner, whose ``take`` raises ``ProducerFailed``."""
        with self._condition:
            self._failure = error
            self._condition.notify_all()

    def take(self, count: int, version: int, timeout: float | None = None) -> list[Group] | None:
        """Remove and return ``count`` groups for the learner at ``version``: the oldest groups the staleness
        bound requires (module docstring), then the preferred ones. Waits until ``count`` groups are held and the
        required ones have finished. Returns None once ``timeout`` seconds passed with no group written (or
        forgotten) meanwhile: a slow but moving rollout keeps the wait going, a stuck one ends it."""
        start = time.perf_counter()
        stale: list[Group] = []
        with self._condition:
            self._version = version
            while True:
                if self._failure is not None:
                    raise ProducerFailed(rollout_failure(self._failure)) from self._failure
                stale += self._drop_stale(version)
                required = self._required(count, version) if len(self.groups) >= count else None
                if required is not None:
                    break
                remaining = None if timeout is None else timeout - (time.perf_counter() - max(start, self._written))
                if remaining is not None and remaining <= 0:
                    self.stats.wait_seconds += time.perf_counter() - start
                    chosen = None
                    break
                self._condition.wait(remaining)
            if required is not None:
                chosen = self._choose(count, version, required)
                taken = {id(g) for g in chosen}
                self.groups = [g for g in self.groups if id(g) not in taken]
                self.stats.taken += sum(g.size for g in chosen)
                self._filter_left = self.filter_budget
                self.stats.wait_seconds += time.perf_counter() - start
        if stale:  # outside the lock, as in ``put``
            self.on_drop(sum(g.size for g in stale))
            self.on_discard(stale)
        return chosen

    def _required(self, count: int, version: int) -> int | None:
        """How many of the oldest held groups this step must take so that every group is trained on by the
        step it falls due; None when that needs groups still running."""
        if self.max_staleness is None:
            return 0
        versions = [g.version for g in self.groups]
        required = 0
        for ahead in range(self.max_staleness + 1):
            limit = version + ahead - self.max_staleness  # groups started at limit or before fall due by then
            held = sum(1 for v in versions if v <= limit)
            running = sum(n for v, n in self.pending.items() if v <= limit)
            need = held + running - ahead * count  # what the `ahead` later steps cannot take
            if need > min(held, count):
                return None
            required = max(required, need)
        return required

    def _drop_stale(self, version: int) -> list[Group]:
        """Drop groups past the bound (left over after a rollback, say); returns them."""
        if self.max_staleness is None:
            return []
        stale = [g for g in self.groups if g.age(version) > self.max_staleness]
        for group in stale:
            self.groups.remove(group)
        self.stats.dropped_stale += sum(g.size for g in stale)
        return stale

    def _choose(self, count: int, version: int, required: int) -> list[Group]:
        oldest_first = sorted(self.groups, key=lambda g: (g.version, g.created))
        chosen, pool = oldest_first[:required], oldest_first[required:]
        if self.sampling == "fifo":
            return chosen + pool[: count - len(chosen)]
        if self.sampling == "fresh":
            newest = sorted(pool, key=lambda g: (-g.version, -g.created))[: count - len(chosen)]
            return chosen + sorted(newest, key=lambda g: (g.version, g.created))
        for _ in range(count - len(chosen)):
            weights = [self.freshness_decay ** g.age(version) for g in pool]
            pick = self.random.choices(range(len(pool)), weights=weights)[0]
            chosen.append(pool.pop(pick))
        return sorted(chosen, key=lambda g: (g.version, g.created))

    def clear(self) -> int:
        """Drop every group (after a rollback: their data belongs to updates given up); returns trajectories."""
        with self._condition:
            dropped = sum(g.size for g in self.groups)
            self.groups, self.pending, self._filter_left = [], {}, self.filter_budget
            return dropped

    def pop_stats(self) -> BufferStats:
        with self._condition:
            stats, self.stats = self.stats, BufferStats()
            return stats
