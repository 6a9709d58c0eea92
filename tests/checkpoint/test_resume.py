"""Checkpointed lm runs: ``train_lm(..., resume=RUN_DIR)`` and ``unipg train --resume`` continue bit for bit."""

import os
import signal
import threading

import pytest
import torch
from typer.testing import CliRunner

import unipg.runtime.lm as text
import unipg.runtime.stopping as stopping
from tests.helpers.configs import resumable_config
from unipg.checkpoint.files import load_checkpoint
from unipg.checkpoint.store import CheckpointStore
from unipg.cli import app
from unipg.observe.metrics import read_metrics
from unipg.runtime.driver import Runtime
from unipg.runtime.lm import TrainingStopped, train_lm

pytestmark = pytest.mark.e2e


def comparable(record: dict) -> dict:
    """A metrics record without its wall-clock entries."""
    return {key: value for key, value in record.items() if key != "time" and not key.startswith(("timing/", "system/"))}


def final_tensors(run_dir) -> dict:
    return load_checkpoint(CheckpointStore(run_dir / "checkpoints").latest()).tensors


@pytest.fixture(scope="module")
def full_run(embedded_path, tmp_path_factory):
    """An uninterrupted run of 4 updates, checkpointing after each."""
    return train_lm(resumable_config(embedded_path, tmp_path_factory.mktemp("runs"), "full", 4))


def assert_continues_like(full_run, resumed):
    assert resumed.updates == 4 and resumed.samples == full_run.samples
    full, other = final_tensors(full_run.run_dir), final_tensors(resumed.run_dir)
    assert set(full) == set(other) == {"policy", "optimizer", "value_head"}
    for group in full:
        assert full[group].keys() == other[group].keys()
        for name in full[group]:
            assert torch.equal(full[group][name], other[group][name]), (group, name)
    full_records = [comparable(r) for r in read_metrics(full_run.run_dir)]
    resumed_records = [comparable(r) for r in read_metrics(resumed.run_dir)]
    assert [r["step"] for r in resumed_records] == [0, 1, 2, 3, 4]  # appended to the same metrics.jsonl
    assert resumed_records == full_records
    assert resumed.eval_history == full_run.eval_history


def test_two_updates_resumed_to_four_equal_four_updates_bit_for_bit(embedded_path, tmp_path, full_run):
    first = train_lm(resumable_config(embedded_path, tmp_path, "split", 2))
    messages = []
    resumed = train_lm(resumable_config(embedded_path, tmp_path, "split", 4), resume=first.run_dir, log=messages.append)
    assert resumed.run_dir == first.run_dir and resumed.resumed_from == 2
    assert any("resuming" in message for message in messages)
    assert_continues_like(full_run, resumed)


def test_sigterm_saves_a_checkpoint_after_the_current_update_and_the_run_resumes_exactly(
    embedded_path, tmp_path, full_run, monkeypatch
):
    calls = []
    original = text.rollout_batch

    def rollout_then_sigterm(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # mid-way through update 2
            os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    monkeypatch.setattr(text, "rollout_batch", rollout_then_sigterm)
    config = resumable_config(embedded_path, tmp_path, "stopped", 4, "checkpoint.every_updates=0")
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(TrainingStopped) as stopped:
        train_lm(config)
    assert stopped.value.update == 2 and stopped.value.signal_number == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == handler  # the run's handler is removed again
    run_dir = stopped.value.run_dir
    assert [path.name for path in CheckpointStore(run_dir / "checkpoints").list()] == ["step-00000002"]
    monkeypatch.setattr(text, "rollout_batch", original)
    assert_continues_like(full_run, train_lm(config, resume=run_dir))


def test_sigterm_during_a_rollout_that_never_ends_stops_with_the_last_finished_update_and_resumes_exactly(
    embedded_path, tmp_path, full_run, monkeypatch
):
    """Update 3's rollout draws its prompts and samples, then never returns: past the grace after the SIGTERM it
    is given up, and the checkpoint of update 2 is saved as if update 3 had never begun."""
    original, calls = Runtime.next_groups, []

    def rollout_that_never_ends(self, *args, **kwargs):
        calls.append(1)
        groups = original(self, *args, **kwargs)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
            threading.Event().wait()
        return groups

    monkeypatch.setattr(Runtime, "next_groups", rollout_that_never_ends)
    monkeypatch.setattr(stopping, "STOP_GRACE_SECONDS", 0.05)
    config = resumable_config(embedded_path, tmp_path, "abandoned", 4, "checkpoint.every_updates=0")
    with pytest.raises(TrainingStopped) as stopped:
        train_lm(config)
    assert stopped.value.update == 2 and stopped.value.signal_number == signal.SIGTERM
    run_dir = stopped.value.run_dir
    assert [path.name for path in CheckpointStore(run_dir / "checkpoints").list()] == ["step-00000002"]
    monkeypatch.setattr(Runtime, "next_groups", original)
    assert_continues_like(full_run, train_lm(config, resume=run_dir))


def test_sigterm_during_an_evaluation_that_never_ends_stops_with_the_update_it_evaluates(
    embedded_path, tmp_path, monkeypatch
):
    """Update 2 is trained, its evaluation never returns: past the grace it is given up, update 2's record is
    logged without it and its checkpoint saved; the run resumes from there."""
    original = text.run_evaluation

    def evaluation_that_never_ends(run, update):
        if update == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            threading.Event().wait()
        return original(run, update)

    monkeypatch.setattr(text, "run_evaluation", evaluation_that_never_ends)
    monkeypatch.setattr(stopping, "STOP_GRACE_SECONDS", 0.05)
    config = resumable_config(embedded_path, tmp_path, "abandoned-eval", 3, "checkpoint.every_updates=0")
    with pytest.raises(TrainingStopped) as stopped:
        train_lm(config)
    assert stopped.value.update == 2
    run_dir = stopped.value.run_dir
    assert [path.name for path in CheckpointStore(run_dir / "checkpoints").list()] == ["step-00000002"]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2] and "eval/pass@1" not in records[-1]
    assert "train/loss" in records[-1]
    monkeypatch.setattr(text, "run_evaluation", original)
    resumed = train_lm(config, resume=run_dir)
    assert resumed.resumed_from == 2 and [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2, 3]


def test_resuming_a_finished_run_trains_nothing_and_says_so_until_updates_is_raised(embedded_path, tmp_path):
    run = train_lm(resumable_config(embedded_path, tmp_path, "done", 2))
    before = (run.run_dir / "metrics.jsonl").read_text()
    messages = []
    again = train_lm(resumable_config(embedded_path, tmp_path, "done", 2), resume=run.run_dir, log=messages.append)
    assert again.resumed_from == 2 and again.updates == 2 and again.samples == run.samples
    assert messages == [f"run {run.run_dir} already finished at update 2 of 2; raise train.updates to train further"]
    assert (run.run_dir / "metrics.jsonl").read_text() == before
    result = CliRunner().invoke(app, ["train", "--resume", str(run.run_dir)])
    assert result.exit_code == 0, result.output
    assert "already finished at update 2 of 2" in " ".join(result.output.split())
    assert (run.run_dir / "metrics.jsonl").read_text() == before
    result = CliRunner().invoke(app, ["train", "--resume", str(run.run_dir), "train.updates=3"])
    assert result.exit_code == 0, result.output
    assert [record["step"] for record in read_metrics(run.run_dir)] == [0, 1, 2, 3]


def test_rotation_keeps_the_last_k_checkpoints(full_run):
    names = [path.name for path in CheckpointStore(full_run.run_dir / "checkpoints").list()]
    assert names == ["step-00000003", "step-00000004"]
    state = load_checkpoint(full_run.run_dir / "checkpoints" / "step-00000004").state
    assert state["update"] == state["policy_version"] == 4 and state["samples"] == full_run.samples


def test_resume_from_a_bad_folder_is_a_clear_error(embedded_path, tmp_path):
    missing = tmp_path / "no-such-run"
    result = CliRunner().invoke(app, ["train", "--resume", str(missing)])
    output = " ".join(result.output.split())
    assert result.exit_code == 2 and str(missing) in output and "not a run folder" in output
    assert "Traceback" not in output

    run = train_lm(resumable_config(embedded_path, tmp_path, "corrupt", 1))
    (checkpoint,) = CheckpointStore(run.run_dir / "checkpoints").list()
    weights = checkpoint / "policy.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="skipping checkpoint"):
        result = CliRunner().invoke(app, ["train", "--resume", str(run.run_dir), "train.updates=2"])
    output = " ".join(result.output.split())
    assert result.exit_code == 2 and str(run.run_dir) in output and "intact" in output
    assert "Traceback" not in output


@pytest.mark.parametrize("change", ["task.name=calculator", "task.options={digits: 1, num_train: 6, num_test: 8}"])
def test_resuming_with_another_training_split_is_a_clear_error_before_anything_is_drawn(
    embedded_path, tmp_path, change
):
    run = train_lm(resumable_config(embedded_path, tmp_path, "split-changed", 1))
    result = CliRunner().invoke(app, ["train", "--resume", str(run.run_dir), "train.updates=2", change])
    output = " ".join(result.output.split())
    assert result.exit_code == 2, output
    assert "another training split" in output and "task.name, task.options" in output
    assert "Traceback" not in output and "IndexError" not in output
    assert [record["step"] for record in read_metrics(run.run_dir)] == [0, 1]  # nothing written was lost
