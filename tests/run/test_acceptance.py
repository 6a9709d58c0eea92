"""Acceptance on CartPole-v1 (slow: about a minute per run; `pytest -m slow`)."""

import pytest

from unipg.config import load_config
from unipg.run.classic import train_classic


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("algorithm", ["ppo", "trpo"])
def test_reaches_475_within_100k_steps(tmp_path, algorithm, seed):
    config = load_config(None, [f"algorithm={algorithm}", f"seed={seed}", "env.total_steps=100000",
                                "eval.episodes=20", f"log.output_dir={tmp_path}", "log.progress=false",
                                "log.tensorboard=false"])
    result = train_classic(config)
    assert result.final_eval_mean >= 475, result.eval_history
