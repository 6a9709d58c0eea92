"""A reward function that returns None for every completion (e.g. one reading a column the task lacks) is
measured per batch, warned about in the run's log when it starts, and flagged by the doctor."""

import asyncio
import json

import pytest
from typer.testing import CliRunner

from tests.helpers.configs import tiny_lm_overrides
from unipg.cli import app
from unipg.config import load_config
from unipg.envs.base import TurnInfo, final_answer_reward
from unipg.observe.doctor import diagnose
from unipg.observe.rollout_metrics import reward_term_metrics
from unipg.runtime.lm import train_lm
from unipg.sample.agent import Trajectory
from unipg.tasks.base import Example
from unipg.tasks.rewards.combine import CombinedReward
from unipg.tasks.rewards.rules import REWARDS


def wrong_column_reward(prompts, completions, **columns):
    """Reads a column no task has: None (not applicable) for every completion."""
    return [None if columns.get("solution_text") is None else 1.0 for _ in completions]


if "wrong_column" not in REWARDS.names():
    REWARDS.register("wrong_column")(lambda: wrong_column_reward)


def scored_trajectories(reward_fn, answers: list[str]) -> list[Trajectory]:
    example = Example("2+2=", "4", "4", {"answer": "4"})
    trajectories = []
    for answer in answers:
        _, info = asyncio.run(final_answer_reward(reward_fn, example, answer))
        trajectories.append(Trajectory(example, [1], infos=[info]))
    trajectories.append(Trajectory(example, [1], infos=[TurnInfo(tool_status="ok")]))  # cut off before answering
    return trajectories


def test_the_none_fraction_of_each_reward_function_is_measured_over_scored_answers():
    def half(prompts, completions, **columns):
        return [None if completion == "5" else 0.5 for completion in completions]

    reward_fn = CombinedReward(
        [
            ("exact", lambda p, c, **k: [float(x == "4") for x in c], 1.0),
            ("wrong_column", wrong_column_reward, 1.0),
            ("half", half, 1.0),
        ]
    )
    trajectories = scored_trajectories(reward_fn, ["4", "5", "4", "4"])
    metrics = reward_term_metrics(trajectories, "rollout")
    assert metrics["rollout/reward_none_fraction/wrong_column"] == 1.0
    assert metrics["rollout/reward_none_fraction/exact"] == 0.0
    assert metrics["rollout/reward_none_fraction/half"] == 0.25
    assert metrics["rollout/reward_exact"] == 0.75 and "rollout/reward_wrong_column" not in metrics


def test_the_doctor_flags_a_reward_function_that_never_applies_and_names_it():
    records = [
        {
            "step": step,
            "rollout/reward_none_fraction/math": 0.0,
            "rollout/reward_none_fraction/wrong_column": 1.0,
            "rollout/reward_none_fraction/format": 1.0 if step == 3 else 0.2,
        }
        for step in range(10)
    ]
    findings = {finding.metric: finding for finding in diagnose(records, checks=["reward_never_applies"])}
    assert set(findings) == {"rollout/reward_none_fraction/wrong_column", "rollout/reward_none_fraction/format"}
    never = findings["rollout/reward_none_fraction/wrong_column"]
    assert (
        never.severity == "error"
        and "'wrong_column' returned None for every completion in 10 of 10" in never.evidence
        and "remove it from task.rewards" in never.remedy
    )
    assert findings["rollout/reward_none_fraction/format"].severity == "warning"


@pytest.mark.e2e
def test_a_run_whose_reward_never_applies_warns_once_in_its_log_and_the_doctor_flags_it(embedded_path, tmp_path):
    config = load_config(
        None,
        tiny_lm_overrides(
            "train.micro_batch_size=8",
            "sample.max_new_tokens=2",
            "eval.pass_k=0",
            "algorithm=grpo",
            "checkpoint.every_updates=0",
            "rollback.enabled=false",
            "train.updates=3",
            "task.rewards=[{name: math}, {name: wrong_column}]",
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
            "log.run_name=wrong-column",
            num_test=4,
        ),
    )
    lines = []
    train_lm(config, log=lines.append)
    run_dir = tmp_path / "wrong-column"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    fractions = [record[key] for record in records for key in record if key.startswith("rollout/reward_none")]
    assert fractions and set(fractions) == {0.0, 1.0}  # math scores every answer, wrong_column none
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    warned = [event for event in events if event.get("check") == "reward_never_applies"]
    assert len(warned) == 1 and "wrong_column" in warned[0]["evidence"]
    result = CliRunner().invoke(app, ["doctor", str(run_dir)])
    assert "[error] reward_never_applies" in result.output and "'wrong_column'" in result.output
