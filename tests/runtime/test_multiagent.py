from pathlib import Path

import pytest

from unipg.config import load_config
from unipg.observe.metrics import read_metrics
from unipg.runtime.lm import train_lm
from unipg.sample.episode_records import read_episode_records

pytestmark = pytest.mark.e2e

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "solver_checker.yaml"
TINY = [
    "task.options={digits: 2, num_train: 30, num_test: 4, max_rounds: 2}",
    "sft.stages=[]",
    "sft.steps=3",
    "sft.batch_size=4",
    "sample.samples_per_prompt=2",
    "sample.max_new_tokens=12",
    "agent.max_total_tokens=48",
    "train.batch_size=4",
    "train.mini_batch_size=4",
    "train.micro_batch_size=8",
    "train.updates=2",
    "eval.every_updates=2",
    "eval.max_examples=2",
    "log.progress=false",
    "log.tensorboard=false",
    "agent.roles={checker: {shaping: 0.2}}",
]


def test_the_solver_checker_config_trains_end_to_end_with_per_role_metrics_and_episodes(tmp_path):
    config = load_config(CONFIG, TINY + [f"log.output_dir={tmp_path}", "log.run_name=team", "log.episodes=true"])
    result = train_lm(config, log=lambda text: None)
    assert result.updates == 2 and result.samples == 16  # 4 episodes per update, one row per role
    steps = [r for r in read_metrics(result.run_dir) if "rollout/reward_mean" in r]
    assert len(steps) == 2
    for role in ("solver", "checker"):
        for metric in ("reward_mean", "response_length", "turns"):
            assert f"rollout/{role}/{metric}" in steps[0], (role, metric)
    records = read_episode_records(result.run_dir / "episodes.jsonl")
    assert len(records) == 16 and {r["role"] for r in records} == {"solver", "checker"}

    # the team's episodes as offline data of another run: groups keep their roles
    second = load_config(
        CONFIG,
        TINY
        + [
            f"log.output_dir={tmp_path}",
            "log.run_name=again",
            f"data.offline={{path: {result.run_dir / 'episodes.jsonl'}, mix: 0.5}}",
        ],
    )
    again = train_lm(second, log=lambda text: None)
    offline = [r for r in read_metrics(again.run_dir) if "offline/share" in r]
    assert [r["offline/share"] for r in offline] == [0.5, 0.5] and all("offline/mean_weight" in r for r in offline)
