"""Resuming a run with groups buffered or in flight (max_staleness > 0): the resumed run trains on exactly the
prompts, in the same order, as the uninterrupted run."""

import pytest

import unipg.runtime.lm as text
from tests.helpers.configs import resumable_config
from unipg.checkpoint.files import load_checkpoint
from unipg.checkpoint.store import CheckpointStore
from unipg.runtime.lm import train_lm
from unipg.runtime.prompts import PromptSampler
from unipg.tasks.base import make_task

GROUPS_PER_STEP = 2  # train.batch_size 8 / sample.samples_per_prompt 4
# one group runs at a time (agent.concurrency = samples_per_prompt), so the concurrent schedule finishes groups
# in the order it admits them and (fifo) trains on them in that order too: the prompt order is deterministic
SCHEDULES = {
    "sequential": ["runtime.schedule=sequential"],
    "concurrent": ["runtime.schedule=concurrent", "agent.concurrency=4"],
}


@pytest.fixture
def trained(monkeypatch):
    """The prompts of the groups each update trains on, in the order of its batch."""
    updates: list[list[str]] = []
    original = text.rollout_batch

    def recording(groups, *args, **kwargs):
        updates.append([group.items[0].example.prompt for group in groups])
        return original(groups, *args, **kwargs)

    monkeypatch.setattr(text, "rollout_batch", recording)
    return updates


def drawn(count: int) -> list[str]:
    """The first ``count`` prompts the run's sampler draws (the task and seed of ``resumable_config``)."""
    task = make_task("arithmetic", digits=1, num_train=40, num_test=8)
    return [example.prompt for example in PromptSampler(task.train, 0).next(count)]


@pytest.mark.e2e
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_a_run_stopped_with_groups_ahead_resumes_on_the_same_prompts_in_the_same_order(
    embedded_path, tmp_path, trained, schedule
):
    extra = ["runtime.max_staleness=2", "checkpoint.every_updates=0", *SCHEDULES[schedule]]
    full = train_lm(resumable_config(embedded_path, tmp_path, "full", 5, *extra))
    uninterrupted = list(trained)
    trained.clear()

    first = train_lm(resumable_config(embedded_path, tmp_path, "split", 2, *extra))
    state = load_checkpoint(CheckpointStore(first.run_dir / "checkpoints").latest()).state
    pending = state["sampler"]["pending"]  # admitted after update 2, not trained on: re-issued first
    if schedule == "sequential":  # the fill of update 1 was 3 steps' worth, each update after adds one
        assert len(pending) == 2 * GROUPS_PER_STEP
    assert len(pending) <= 3 * GROUPS_PER_STEP  # the staleness gate's bound, at version 2
    resumed = train_lm(resumable_config(embedded_path, tmp_path, "split", 5, *extra), resume=first.run_dir)

    assert resumed.resumed_from == 2 and resumed.samples == full.samples
    assert len(trained) == len(uninterrupted) == 5
    assert trained == uninterrupted
    assert [prompt for update in trained for prompt in update] == drawn(5 * GROUPS_PER_STEP)


def test_the_sampler_draws_a_checkpoints_pending_prompts_first_and_forgets_the_settled_ones():
    task = make_task("arithmetic", digits=1, num_train=40, num_test=8)
    sampler, reference = PromptSampler(task.train, 3), PromptSampler(task.train, 3)
    expected = reference.next(12)
    first = sampler.next(6)
    assert first == expected[:6]

    class Trajectory:
        def __init__(self, example):
            self.example = example

    class Group:
        def __init__(self, example):
            self.items = [Trajectory(example)]

    sampler.settle([Group(first[1]), Group(first[0])])  # trained on; first[2:] still buffered or running
    state = sampler.state()
    assert [task.train[i] for i in state["pending"]] == first[2:]
    again = PromptSampler(task.train, 99)
    again.load_state(state)
    assert again.next(2) == first[2:4]
    assert again.state()["pending"] == state["pending"]  # drawn again, still pending until settled
    assert again.next(6) == first[4:6] + expected[6:10]
