"""A training run whose episodes are played by an external agent through the endpoint."""

import json

import pytest

from tests.helpers.configs import EXTERNAL_AGENT_RUN as RUN
from unipg.config import load_config
from unipg.observe.metrics import read_metrics
from unipg.runtime.lm import train_lm
from unipg.sample.transcripts import format_transcript

pytestmark = pytest.mark.e2e


def test_an_external_agent_trains_like_the_built_in_loop_and_its_failures_are_logged(embedded_path, tmp_path):
    config = load_config(
        None, [*RUN, f"model.name={embedded_path}", f"log.output_dir={tmp_path}", "log.run_name=external"]
    )
    train_lm(config, log=lambda line: None)
    records = [json.loads(line) for line in (tmp_path / "external" / "metrics.jsonl").read_text().splitlines()]
    rollouts = [record for record in records if "rollout/agent_failures" in record]
    assert len(rollouts) == 2 and all(record["rollout/agent_failures"] == 0 for record in rollouts)
    assert all(record["rollout/turns"] == 2 for record in rollouts)
    assert any("eval/pass@1" in record for record in records)  # evaluation plays the agent too


def test_an_external_agent_runs_in_the_concurrent_schedule(embedded_path, tmp_path):
    config = load_config(
        None,
        [
            *RUN,
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
            "log.run_name=concurrent",
            "runtime.max_staleness=1",
            "runtime.schedule=concurrent",
            "eval.every_updates=100",
        ],
    )
    train_lm(config, log=lambda line: None)
    records = [json.loads(line) for line in (tmp_path / "concurrent" / "metrics.jsonl").read_text().splitlines()]
    assert sum("rollout/agent_failures" in record for record in records) == 2


def test_every_trajectory_of_an_agent_that_rewrites_its_history_is_trained(embedded_path, tmp_path):
    agent = "task.agent=tests.inference.endpoint.agents_for_tests:rewrites_history"
    config = load_config(
        None,
        [
            *RUN,
            agent,
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
            "log.run_name=rewrites",
            "eval.every_updates=100",
            "log.episodes=true",
        ],
    )
    train_lm(config, log=lambda line: None)
    records = [json.loads(line) for line in (tmp_path / "rewrites" / "metrics.jsonl").read_text().splitlines()]
    rollouts = [record for record in records if "rollout/agent_failures" in record]
    assert [record["rollout/agent_extra_trajectories"] for record in rollouts] == [8, 8]  # one per episode
    assert [record["train/samples"] for record in rollouts] == [16, 32]  # both trajectories of every episode
    assert all(record["rollout/turns"] == 2 for record in rollouts)  # episode metrics: the main trajectory's
    episodes = [json.loads(line) for line in (tmp_path / "rewrites" / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 16 and all(len(episode["side"]) == 1 for episode in episodes)  # written beside its main
    side = episodes[0]["side"][0]
    assert side["token_ids"] and side["messages"][0]["role"] == "user" and "side" not in side
    shown = [
        json.loads(line)
        for path in sorted((tmp_path / "rewrites" / "transcripts").glob("*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    assert shown and all(len(record["side"]) == 1 and record["side"][0]["turns"] for record in shown)
    assert "side 1:" in format_transcript(shown[0]) and "\n  prompt:" in format_transcript(shown[0])

    # trained again as offline data by the built-in loop: each recorded episode is two rows, as when it was sampled
    replay = load_config(
        None,
        [
            *RUN,
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
            "log.run_name=replay",
            "eval.every_updates=100",
            "train.updates=1",
            f"data.offline={{path: {tmp_path / 'rewrites' / 'episodes.jsonl'}, mix: 0.5}}",
        ],
    )
    train_lm(replay, log=lambda line: None)
    step = next(r for r in read_metrics(tmp_path / "replay") if "offline/share" in r)
    assert step["offline/share"] == 8 / 12 and step["train/samples"] == 12  # 4 episodes of 2 rows, 4 fresh ones
