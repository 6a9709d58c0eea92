"""Checkpointed gym runs: ``train_gym(..., resume=RUN_DIR)`` and ``unipg train --resume`` continue bit for bit."""

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from unipg.checkpoint.files import load_checkpoint
from unipg.checkpoint.store import CheckpointStore
from unipg.cli import app
from unipg.config import load_config
from unipg.observe.metrics import read_metrics
from unipg.runtime.gym import train_gym

pytestmark = pytest.mark.e2e

SMALL = [
    "algorithm=ppo",
    "env.id=CartPole-v1",
    "env.num_envs=4",
    "train.batch_transitions=256",
    "train.mini_batch_transitions=128",
    "train.num_epochs=2",
    "train.lr_schedule=constant",
    "estimator.normalize_rewards=true",
    "eval.every_steps=512",
    "eval.episodes=2",
    "log.log_every_updates=3",
    "log.progress=false",
    "log.tensorboard=false",
    "deterministic=true",
    "checkpoint.every_updates=2",
    "checkpoint.keep_last=2",
    "checkpoint.keep_best=false",
]
FULL_STEPS = 2048  # 8 updates


def small_config(output_dir, name, total_steps, *extra):
    return load_config(
        None, SMALL + [f"log.output_dir={output_dir}", f"log.run_name={name}", f"env.total_steps={total_steps}", *extra]
    )


def comparable(record: dict) -> dict:
    """A metrics record without its wall-clock entries."""
    return {key: value for key, value in record.items() if key != "time" and not key.startswith(("timing/", "system/"))}


def final_tensors(run_dir) -> dict:
    return load_checkpoint(CheckpointStore(run_dir / "checkpoints").latest()).tensors


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    return train_gym(small_config(tmp_path_factory.mktemp("runs"), "full", FULL_STEPS))


def assert_continues_like(full_run, resumed):
    assert resumed.env_steps == full_run.env_steps == FULL_STEPS and resumed.episodes == full_run.episodes
    full, other = final_tensors(full_run.run_dir), final_tensors(resumed.run_dir)
    assert set(full) == set(other) and {"policy", "optimizer"} <= set(full)
    for group in full:
        assert full[group].keys() == other[group].keys()
        for name in full[group]:
            assert torch.equal(full[group][name], other[group][name]), (group, name)
    full_records = [comparable(r) for r in read_metrics(full_run.run_dir)]
    assert [comparable(r) for r in read_metrics(resumed.run_dir)] == full_records
    assert resumed.eval_history == full_run.eval_history


@pytest.mark.parametrize("steps", [768, 1024])  # stopped after update 3 (log line pending) or 4
def test_a_run_resumed_with_more_steps_equals_an_uninterrupted_one_bit_for_bit(tmp_path, full_run, steps):
    first = train_gym(small_config(tmp_path, "split", steps))
    messages = []
    resumed = train_gym(small_config(tmp_path, "split", FULL_STEPS), resume=first.run_dir, log=messages.append)
    assert resumed.run_dir == first.run_dir
    assert messages == [f"resuming {first.run_dir} from update {steps // 256} of 8"]
    assert_continues_like(full_run, resumed)


def test_rotation_keeps_the_last_k_checkpoints(full_run):
    names = [path.name for path in CheckpointStore(full_run.run_dir / "checkpoints").list()]
    assert names == ["step-00000006", "step-00000008"]
    state = load_checkpoint(full_run.run_dir / "checkpoints" / "step-00000008").state
    assert state["update"] == 8 and state["run"]["progression"]["env_steps"] == FULL_STEPS


def test_cli_resumes_a_gym_run_and_a_finished_run_trains_nothing(tmp_path, full_run):
    first = train_gym(small_config(tmp_path, "cli", 1024))
    result = CliRunner().invoke(app, ["train", "--resume", str(first.run_dir)])
    assert result.exit_code == 0, result.output
    assert "already finished at update 4 of 4" in " ".join(result.output.split())
    result = CliRunner().invoke(app, ["train", "--resume", str(first.run_dir), f"env.total_steps={FULL_STEPS}"])
    assert result.exit_code == 0, result.output
    assert [comparable(r) for r in read_metrics(first.run_dir)] == [
        comparable(r) for r in read_metrics(full_run.run_dir)
    ]


def test_a_trpo_run_resumes_bit_for_bit_too(tmp_path):
    extra = ["algorithm=trpo", "train.num_epochs=1"]
    full = train_gym(small_config(tmp_path, "trpo-full", 1536, *extra))
    first = train_gym(small_config(tmp_path, "trpo-split", 768, *extra))
    resumed = train_gym(small_config(tmp_path, "trpo-split", 1536, *extra), resume=first.run_dir, log=lambda _: None)
    full_tensors, resumed_tensors = final_tensors(full.run_dir), final_tensors(resumed.run_dir)
    for group in full_tensors:
        for name in full_tensors[group]:
            assert torch.equal(full_tensors[group][name], resumed_tensors[group][name]), (group, name)
    assert [comparable(r) for r in read_metrics(resumed.run_dir)] == [comparable(r) for r in read_metrics(full.run_dir)]


def test_a_killed_run_resumes_from_its_newest_checkpoint_and_rewrites_the_records_after_it(tmp_path, full_run):
    """A run killed after update 7 has checkpoint 6 (and 4, rotated away) and the records of update 7 on disk."""
    run_dir = tmp_path / "killed"
    shutil.copytree(full_run.run_dir, run_dir, ignore=shutil.ignore_patterns(".lock"))
    CheckpointStore(run_dir / "checkpoints").remove(8)
    records = read_metrics(run_dir)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records if r["step"] <= 7 * 256))
    messages = []
    resumed = train_gym(small_config(tmp_path, "killed", FULL_STEPS), resume=run_dir, log=messages.append)
    assert messages == [f"resuming {run_dir} from update 6 of 8"]
    assert_continues_like(full_run, resumed)
