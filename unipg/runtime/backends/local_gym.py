"""Gym rollout segments as the ``Rollout`` of ``unipg.runtime.driver.Runtime``.

One group is one rollout segment: every environment of the vector stepped ``steps_per_env`` times, one
learner step's worth of data. So for the gym driver the runtime counts in segments: the gate admits
``max_staleness + 1`` segments ahead of the learner, and ``sample.replay_buffer_size`` is the buffer's
capacity in segments, not in episodes or environment steps.

Which weights act depends on the schedule:

- ``sequential``: segments are collected on the learner's thread between learner steps, with the learner's
  own policy; there is nothing to publish.
- ``concurrent``: a background thread collects with its own copy of the policy, which a ``WeightSync``
  brings up to the newest published weights before each segment.
"""

from __future__ import annotations

import copy
import threading
import time

from unipg.policy.mlp import MLPActorCritic
from unipg.runtime.driver import RolloutReport, WeightSync, serve_one_by_one
from unipg.runtime.replay import Group, ReplayBuffer, StalenessGate
from unipg.sample.gym_rollout import GymRollout


class GymSegments:
    """Collects ``GymRollout`` segments and stamps each with the learner version that started it."""

    def __init__(
        self, rollout: GymRollout, policy: MLPActorCritic, *, steps_per_env: int, bootstrap: bool, concurrent: bool
    ):
        self.rollout, self.steps_per_env, self.bootstrap = rollout, steps_per_env, bootstrap
        self.policy = copy.deepcopy(policy) if concurrent else policy
        self.sync = WeightSync(policy, self.policy) if concurrent else None
        self._busy, self._since = 0.0, time.perf_counter()  # seconds spent collecting since the last report

    def produce(self, count: int, version: int) -> list[Group]:
        """``count`` segments, now. In the concurrent schedule the weights may have moved past ``version``
        by the time they are pulled; the segment keeps the admitted ``version`` (its age is then
        overstated by at most one, never understated), which is also what the buffer's bookkeeping of
        admitted groups expects."""
        groups = []
        for _ in range(count):
            start = time.perf_counter()
            if self.sync is not None:
                self.sync.pull()
            batch = self.rollout.collect(self.policy, self.steps_per_env, bootstrap=self.bootstrap)
            groups.append(Group(items=[batch], version=version, size=1))
            self._busy += time.perf_counter() - start
        return groups

    def serve(self, gate: StalenessGate, buffer: ReplayBuffer, stop: threading.Event) -> None:
        """Collect the segments ``gate`` admits, one at a time, into ``buffer`` until ``stop`` is set."""
        serve_one_by_one(self, gate, buffer, stop, group_size=1)

    def publish(self, version: int) -> None:
        """Snapshot the learner's weights for the collecting copy (nothing to do in the sequential schedule)."""
        if self.sync is not None:
            self.sync.publish(version)

    def report(self) -> RolloutReport:
        """The seconds since the last report in which no segment was being collected (the concurrent schedule's
        rollout idle time, waiting on the staleness gate) and spent syncing weights (None: sequential, no sync).
        Nothing else: a gym policy acts in one forward pass per environment step, with no generate calls; its
        environments run in-process, without an environment service; the gym driver counts episodes itself."""
        now = time.perf_counter()
        idle = max(now - self._since - self._busy, 0.0)
        self._since, self._busy = now, 0.0
        return RolloutReport(idle_seconds=idle, sync_seconds=self.sync.pop_seconds() if self.sync is not None else None)

    def resume_episodes(self, state: dict[str, int] | None) -> None:
        """Nothing to do: there are no episode counts to continue (the gym driver's checkpoints keep its own)."""

    def close(self) -> None:
        """Nothing to do: the ``GymRollout`` and its environments are the driver's, closed by it."""
