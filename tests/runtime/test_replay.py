import random
import threading
import time
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unipg.runtime.replay import Group, ProducerFailed, ReplayBuffer, StalenessGate


def group(version: int, size: int = 2, tag: str = "") -> Group:
    return Group([f"{tag}{version}-{i}" for i in range(size)], version, size)


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(2, 20),
    sizes=st.lists(st.integers(1, 2), min_size=1, max_size=60),
    eviction=st.sampled_from(["oldest", "probabilistic"]),
)
def test_the_buffer_never_holds_more_trajectories_than_its_capacity(capacity, sizes, eviction):
    dropped = []
    buffer = ReplayBuffer(capacity, eviction=eviction, on_drop=dropped.append)
    for index, size in enumerate(sizes):
        buffer.put(group(index // 3, size))
        assert len(buffer) <= capacity
    assert sum(dropped) == buffer.stats.evicted == sum(sizes) - len(buffer)


def test_groups_are_taken_whole_and_oldest_first_by_default():
    buffer = ReplayBuffer(100)
    for version in (0, 0, 1, 2):
        buffer.put(group(version, size=3))
    taken = buffer.take(2, version=2)
    assert [g.version for g in taken] == [0, 0] and all(len(g.items) == 3 for g in taken)
    assert len(buffer) == 6


def test_fresh_sampling_takes_the_newest_groups():
    buffer = ReplayBuffer(100, sampling="fresh")
    for version in (0, 1, 2, 3):
        buffer.put(group(version))
    assert [g.version for g in buffer.take(2, version=3)] == [2, 3]


def test_weighted_sampling_prefers_fresh_groups_in_proportion_to_the_decay():
    counts = Counter()
    for seed in range(400):
        buffer = ReplayBuffer(100, sampling="weighted", freshness_decay=0.5, seed=seed)
        for version in (0, 1, 2):
            buffer.put(group(version))
        counts[buffer.take(1, version=2)[0].version] += 1
    # P ∝ 0.5^age: 1/7, 2/7, 4/7
    assert counts[2] > counts[1] > counts[0]
    assert abs(counts[2] / 400 - 4 / 7) < 0.08 and abs(counts[0] / 400 - 1 / 7) < 0.06


def test_oldest_eviction_drops_the_oldest_and_probabilistic_eviction_mostly_old_groups():
    buffer = ReplayBuffer(4)
    for version in (0, 1, 2):
        buffer.put(group(version))
    assert [g.version for g in buffer.groups] == [1, 2]
    victims = Counter()
    for seed in range(300):
        buffer = ReplayBuffer(4, eviction="probabilistic", seed=seed)
        for version in (0, 5):
            buffer.put(group(version))
        buffer.put(group(6))
        victims[({0, 5, 6} - {g.version for g in buffer.groups}).pop()] += 1
    # P ∝ age + 1 = 7, 2, 1 out of 10
    assert victims[0] > victims[5] > victims[6] and abs(victims[0] / 300 - 0.7) < 0.1


def test_a_group_larger_than_the_buffer_says_which_setting_to_raise():
    with pytest.raises(ValueError, match="replay_buffer_size"):
        ReplayBuffer(2).put(group(0, size=3))


def test_groups_past_the_staleness_bound_are_dropped_and_give_their_slots_back():
    gate = StalenessGate(1, per_step=2)
    buffer = ReplayBuffer(100, max_staleness=1, sampling="fresh", on_drop=gate.release)
    assert gate.admit(2, timeout=0) == (0, 1) and gate.room() == 2
    buffer.put(group(0))
    buffer.put(group(2))
    assert [g.version for g in buffer.take(1, version=2)] == [2]
    assert buffer.stats.dropped_stale == 2 and gate.room() == 4


def test_the_gate_admits_max_staleness_plus_one_steps_ahead_and_more_after_each_publish():
    gate = StalenessGate(2, per_step=4)
    assert gate.admit(2, timeout=0, most=100) == (0, 6)  # (0 + 2 + 1) · 4 = 12 trajectories
    assert gate.admit(2, timeout=0) is None
    gate.publish(1)
    assert gate.admit(2, timeout=0, most=1) == (1, 1) and gate.room() == 2


def test_a_learner_step_does_not_wait_on_a_slow_episode_when_fresh_data_is_buffered():
    buffer = ReplayBuffer(100, max_staleness=2)
    buffer.expect(5, 2)  # a group of version 5 still running (a slow tool call)
    buffer.put(group(4))
    buffer.put(group(5, tag="b"))
    start = time.perf_counter()
    taken = buffer.take(2, version=5, timeout=60.0)
    assert taken is not None and time.perf_counter() - start < 30.0  # not the 60 s timeout


def test_the_learner_waits_for_a_running_group_that_is_due():
    """A slow group must be trained on before it would exceed the bound, not dropped and not left behind."""
    buffer = ReplayBuffer(100, max_staleness=1)
    buffer.expect(3, 2)  # started at version 3: due at learner version 4
    buffer.put(group(4))
    buffer.put(group(4, tag="b"))
    assert buffer.take(2, version=4, timeout=0.05) is None
    threading.Timer(0.05, lambda: buffer.put(group(3))).start()
    taken = buffer.take(2, version=4, timeout=5.0)
    assert [g.version for g in taken] == [3, 4]


def test_a_failed_rollout_is_raised_on_the_learners_side():
    buffer = ReplayBuffer(10)
    buffer.fail(RuntimeError("tool crashed"))
    with pytest.raises(ProducerFailed, match="tool crashed"):
        buffer.take(1, version=0)


@settings(max_examples=15, deadline=None)
@given(max_staleness=st.integers(0, 3), groups_per_step=st.integers(1, 3), seed=st.integers(0, 10_000))
def test_staleness_never_exceeds_the_bound_under_random_episode_latencies(max_staleness, groups_per_step, seed):
    """Rollout threads run groups with heavy-tailed random durations while a learner takes batches: every
    group trained on is at most max_staleness versions old, no group is lost, the buffer stays in capacity."""
    size, steps, rng = 2, 8, random.Random(seed)
    gate_buffer = ReplayBuffer(64, max_staleness=max_staleness)
    gate = StalenessGate(max_staleness, groups_per_step * size, on_admit=gate_buffer.expect)
    gate_buffer.on_drop = gate.release
    stop = threading.Event()
    delays = [min(rng.lognormvariate(-7, 1.2), 0.02) for _ in range(10_000)]

    def worker(index: int) -> None:
        while not stop.is_set():
            admitted = gate.admit(size, timeout=0.01)
            if admitted is not None:
                time.sleep(delays[(index * 7919 + gate.started) % len(delays)])
                gate_buffer.put(group(admitted[0], size))

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(4)]
    for thread in threads:
        thread.start()
    try:
        for version in range(steps):
            taken = gate_buffer.take(groups_per_step, version, timeout=10.0)
            assert taken is not None and len(taken) == groups_per_step
            assert all(0 <= g.age(version) <= max_staleness for g in taken)
            assert len(gate_buffer) <= gate_buffer.capacity
            gate.publish(version + 1)
    finally:
        stop.set()
        gate.close()
        for thread in threads:
            thread.join()
    assert gate_buffer.stats.dropped_stale == 0 and gate_buffer.stats.evicted == 0


def test_groups_the_keep_test_rejects_are_dropped_within_a_budget_per_step():
    released, discarded = [], []
    buffer = ReplayBuffer(
        100,
        keep=lambda g: g.items[0].startswith("mixed"),
        filter_budget=2,
        on_drop=released.append,
        on_discard=discarded.extend,
    )
    for tag in ("alike", "mixed", "alike", "alike"):  # the third alike group is past the budget: kept
        buffer.put(group(0, size=4, tag=tag))
    assert [g.items[0] for g in buffer.groups] == ["mixed0-0", "alike0-0"]
    assert released == [4, 4] and [g.items[0] for g in discarded] == ["alike0-0", "alike0-0"]
    assert buffer.stats.filtered == 8 and buffer.stats.evicted == 0
    buffer.take(2, version=0)  # a learner step: the budget is whole again
    buffer.put(group(1, size=4, tag="alike"))
    assert len(buffer) == 0 and buffer.pop_stats().filtered == 12


def test_a_step_waiting_on_a_running_group_that_the_test_rejects_stops_waiting_for_it():
    buffer = ReplayBuffer(100, max_staleness=0, keep=lambda g: not g.items[0].startswith("alike"), filter_budget=1)
    buffer.expect(0, 2)
    buffer.put(group(0, tag="mixed"))
    buffer.expect(0, 2)  # running: with staleness 0 a step takes nothing until every group of its version ended
    assert buffer.take(1, version=0, timeout=0.0) is None
    buffer.put(group(0, tag="alike"))  # rejected: nothing of version 0 is running any more
    assert [g.items[0] for g in buffer.take(1, version=0, timeout=0.0)] == ["mixed0-0"]
