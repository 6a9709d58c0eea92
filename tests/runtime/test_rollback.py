"""Rollback of lm runs: skipped non-finite steps, reverted KL spikes, and rolling back to a checkpoint."""

import json

import pytest
import torch

from tests.helpers.configs import tiny_lm_overrides
from unipg.checkpoint.store import CheckpointStore, load_checkpoint
from unipg.config import load_config
from unipg.learn.lm import LMBatch, LMLearner
from unipg.observe.metrics import read_metrics
from unipg.runtime.lm import train_lm

SMALL = tiny_lm_overrides(
    "train.mini_batch_size=4",
    "train.micro_batch_size=4",
    "eval.every_updates=10",
    "eval.pass_k=0",
    "algorithm=grpo",
    "estimator.kl_coef=0.0",
)


def make_config(*overrides):
    return load_config(None, SMALL + list(overrides))


@pytest.fixture
def policy(tiny_policy):
    return tiny_policy()


def prepared_batch(policy, learner) -> LMBatch:
    """Two prompts of four sampled completions each, with advantages."""
    tokenizer = policy.tokenizer
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{i}+{i}="}], tokenize=False, add_generation_prompt=True
        )
        for i in (3, 4)
    ]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts for _ in range(4)]
    generation = policy.sample(ids, max_new_tokens=4, generator=torch.Generator().manual_seed(0))
    batch = LMBatch.from_generation(generation, [float(i % 2) for i in range(len(ids))])
    learner.prepare(batch)
    return batch


def poison(monkeypatch, updates: set[int]) -> None:
    """Make the loss NaN (so every gradient is NaN) in the given updates (1-based calls of LMLearner.update)."""
    calls = []
    update, loss = LMLearner.update, LMLearner._loss

    def counted_update(self, batch):
        calls.append(None)
        self.poisoned = len(calls) in updates
        return update(self, batch)

    def poisoned_loss(self, micro):
        value, metrics = loss(self, micro)
        return (value * float("nan") if self.poisoned else value), metrics

    monkeypatch.setattr(LMLearner, "update", counted_update)
    monkeypatch.setattr(LMLearner, "_loss", poisoned_loss)


def parameters(learner: LMLearner) -> list[torch.Tensor]:
    return [p.detach().clone() for p in learner.parameters]


def bitwise_equal(first: list[torch.Tensor], second: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_a_non_finite_gradient_skips_the_step_and_leaves_the_parameters(policy, monkeypatch):
    learner = LMLearner(policy, make_config("train.learning_rate=1e-2"))
    batch = prepared_batch(policy, learner)
    poison(monkeypatch, {1})
    before = parameters(learner)
    metrics = learner.update(batch)
    assert metrics["skipped_steps"] == 2.0  # both mini-batches of the one epoch
    assert bitwise_equal(before, parameters(learner))
    assert not learner.optimizer.state and all(p.grad is None for p in learner.parameters)
    assert "reverted" not in metrics  # target_kl is not set: no copy, no KL check
    assert learner.update(batch)["skipped_steps"] == 0.0  # the next update trains again
    assert not bitwise_equal(before, parameters(learner))


def test_a_kl_spike_reverts_the_whole_update_bit_for_bit(policy):
    learner = LMLearner(
        policy, make_config("train.learning_rate=1e-2", "train.num_epochs=2", "estimator.target_kl=1e-12")
    )
    assert learner.kl_spike == pytest.approx(1e-11)
    batch = prepared_batch(policy, learner)
    learner.kl_spike = None  # one normal update first, so that the optimizer has state to restore
    learner.update(batch)
    learner.kl_spike = 1e-11
    before, optimizer_before = parameters(learner), learner.optimizer.state_dict()
    optimizer_before = {
        index: {key: value.clone() for key, value in state.items()}
        for index, state in optimizer_before["state"].items()
    }
    controller_before = learner.kl_controller.state_dict()
    metrics = learner.update(batch)
    assert metrics["reverted"] == 1.0 and metrics["approx_kl"] > 1e-11 and metrics["skipped_steps"] == 0.0
    assert bitwise_equal(before, parameters(learner))
    after = learner.optimizer.state_dict()["state"]
    assert after.keys() == optimizer_before.keys()
    for index, state in optimizer_before.items():
        assert all(torch.equal(value, after[index][key]) for key, value in state.items())
    assert learner.kl_controller.state_dict() == controller_before


@pytest.mark.e2e
def test_repeated_trips_roll_back_to_the_last_checkpoint_with_a_lower_learning_rate(
    embedded_path, tmp_path, monkeypatch, capsys
):
    overrides = [
        f"model.name={embedded_path}",
        f"log.output_dir={tmp_path}",
        "log.run_name=run",
        "rollback.max_trips=2",
        "rollback.lr_factor=0.5",
        "train.learning_rate=1e-3",
    ]
    poison(monkeypatch, {2, 3})  # updates 2 and 3 trip; the run rolls back to update 1 and trains on
    result = train_lm(make_config("train.updates=3", "checkpoint.every_updates=1", *overrides))
    events = [json.loads(line) for line in (result.run_dir / "events.jsonl").read_text().splitlines()]
    tripped = [event for event in events if event["event"] == "skipped_update"]
    assert [event["step"] for event in tripped] == [2, 3]
    assert "non-finite" in tripped[0]["reason"]
    rollbacks = [event for event in events if event["event"] == "rollback"]
    assert rollbacks == [{"step": 3, "event": "rollback", "to_update": 2, "learning_rate_factor": 0.5}]
    assert "rolled back to update 2" in capsys.readouterr().err
    records = [record for record in read_metrics(result.run_dir) if "train/learning_rate" in record]
    assert [r["step"] for r in records] == [1, 2, 3, 3]  # the given-up update 3 keeps its record
    assert [r["train/learning_rate"] for r in records] == [1e-3, 1e-3, 1e-3, 5e-4]
    assert [r["train/skipped_steps"] for r in records] == [0.0, 2.0, 2.0, 0.0]
    final = load_checkpoint(CheckpointStore(result.run_dir / "checkpoints").latest())
    assert final.step == 3 and final.state["learner"]["lr_factor"] == 0.5
    resumed = train_lm(make_config("train.updates=4", "checkpoint.every_updates=1", *overrides), resume=result.run_dir)
    assert resumed.resumed_from == 3
    assert read_metrics(result.run_dir)[-1]["train/learning_rate"] == 5e-4  # the factor survives a resume


@pytest.mark.e2e
def test_a_fresh_run_rolls_back_to_its_initial_checkpoint(embedded_path, tmp_path, monkeypatch):
    poison(monkeypatch, {1, 2})
    result = train_lm(
        make_config(
            "train.updates=2", "rollback.max_trips=2", f"model.name={embedded_path}", f"log.output_dir={tmp_path}"
        )
    )
    events = [json.loads(line) for line in (result.run_dir / "events.jsonl").read_text().splitlines()]
    assert [event for event in events if event["event"] == "rollback"] == [
        {"step": 2, "event": "rollback", "to_update": 0, "learning_rate_factor": 0.5}
    ]
    assert result.samples == 16  # the two updates given up do not count
    checkpoints = CheckpointStore(result.run_dir / "checkpoints").list()
    assert [path.name for path in checkpoints] == ["step-00000002"]  # the initial one served its purpose


@pytest.mark.e2e
def test_a_run_that_keeps_tripping_stops_with_a_clear_error(embedded_path, tmp_path, monkeypatch):
    poison(monkeypatch, set(range(1, 50)))
    config = make_config(
        "train.updates=2",
        "rollback.max_trips=1",
        "rollback.max_rollbacks=2",
        f"model.name={embedded_path}",
        f"log.output_dir={tmp_path}",
    )
    with pytest.raises(ValueError, match="keep tripping after 2 rollbacks"):
        train_lm(config)
    run_dir = next(tmp_path.iterdir())
    events = [json.loads(line)["event"] for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert events.count("rollback") == 2 and events[-1] == "gave_up"
    assert (run_dir / "metrics.jsonl").read_text()  # what was logged is kept


def test_with_rollback_disabled_nothing_is_skipped_or_reverted(policy, monkeypatch):
    learner = LMLearner(
        policy,
        make_config(
            "train.learning_rate=1e-2", "train.num_epochs=2", "estimator.target_kl=1e-12", "rollback.enabled=false"
        ),
    )
    assert learner.kl_spike is None
    batch = prepared_batch(policy, learner)
    before = parameters(learner)
    metrics = learner.update(batch)  # a KL far beyond 10 × target_kl
    assert metrics["approx_kl"] > 1e-11 and "reverted" not in metrics and "skipped_steps" not in metrics
    assert not bitwise_equal(before, parameters(learner))
    poison(monkeypatch, {1})
    learner.update(batch)  # the NaN gradient is applied
    assert any(p.isnan().any() for p in learner.parameters)
