"""Acceptance: CartPole-v1 and the README's main job (slow: minutes per run; `pytest -m slow`)."""

from pathlib import Path

import pytest

from unipg.config import load_config
from unipg.runtime.gym import train_gym
from unipg.runtime.lm import train_lm

pytestmark = pytest.mark.e2e

MAIN_JOB = Path(__file__).resolve().parents[2] / "configs" / "calculator_agent.yaml"


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("algorithm", ["ppo", "trpo"])
def test_reaches_475_within_100k_steps(tmp_path, algorithm, seed):
    config = load_config(
        None,
        [
            f"algorithm={algorithm}",
            f"seed={seed}",
            "env.total_steps=100000",
            "eval.episodes=20",
            f"log.output_dir={tmp_path}",
            "log.progress=false",
            "log.tensorboard=false",
        ],
    )
    result = train_gym(config)
    assert result.final_eval_mean >= 475, result.eval_history


@pytest.mark.slow
def test_the_main_job_teaches_the_embedded_model_to_use_the_calculator(tmp_path, monkeypatch):
    """configs/calculator_agent.yaml from an empty cache, warm start included (about 8 minutes on two cores):
    sampled episodes go from guessing (almost never right) to calling the tool; held-out greedy completion ends
    at 85% or more, every greedy episode calling the tool."""
    monkeypatch.setenv("UNIPG_CACHE", str(tmp_path / "cache"))
    config = load_config(MAIN_JOB, [f"log.output_dir={tmp_path}", "log.progress=false", "log.tensorboard=false"])
    result = train_lm(config)
    assert result.initial_eval["eval/sampled_completion"] < 0.1
    assert result.final_eval["eval/sampled_completion"] >= 0.3, result.eval_history
    assert result.final_eval["eval/pass@1"] >= 0.85, result.eval_history
    assert result.final_eval["eval/tool_calls"] >= 0.9
