"""The public API a notebook uses: ``import unipg; unipg.train(...)``."""

from pathlib import Path

import pytest

import unipg

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
def test_train_a_config_file_with_keyword_overrides(tmp_path):
    result = unipg.train(
        ROOT / "configs" / "cartpole_ppo.yaml",
        env__total_steps=512,
        eval__every_steps=512,
        eval__episodes=2,
        log__output_dir=str(tmp_path),
        log__tensorboard=False,
    )
    assert result.run_dir.parent == tmp_path and (result.run_dir / "metrics.jsonl").is_file()
    assert result.config.env.total_steps == 512
    assert result.details.env_steps == 512
    assert "eval/return_mean" in result.metrics and result.metrics["eval/return_mean"] > 0


def test_load_config_accepts_a_config_and_the_command_line_override_form():
    base = unipg.load_config(ROOT / "configs" / "cartpole_ppo.yaml")
    assert isinstance(base, unipg.Config)
    changed = unipg.load_config(base, estimator__clip_range=0.1, overrides=["train.num_epochs=3"])
    assert changed.estimator.clip_range == 0.1 and changed.train.num_epochs == 3
    assert changed.env.id == "CartPole-v1" and base.estimator.clip_range == 0.2
    assert unipg.load_config(base) is base


def test_a_bad_setting_is_a_config_error_that_says_what_to_fix():
    with pytest.raises(unipg.ConfigError, match="clip_range"):
        unipg.load_config(ROOT / "configs" / "cartpole_ppo.yaml", estimator__clip_range=2.0)


def test_the_package_exports_the_api():
    assert set(unipg.__all__) >= {"train", "evaluate", "load_config", "Config", "ConfigError", "RunResult"}


def test_the_backend_is_a_registered_name():
    from unipg.runtime.backends import BACKENDS

    assert BACKENDS.names() == ["inprocess", "ray"]
    with pytest.raises(
        unipg.ConfigError, match=r"unknown backend 'rayy'; did you mean 'ray'\? Valid names: inprocess, ray"
    ):
        unipg.load_config(None, overrides=["task.name=arithmetic", "backend=rayy"])
