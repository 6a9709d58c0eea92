import pytest
from typer.testing import CliRunner

from unipg.cli import app

runner = CliRunner()


@pytest.mark.e2e
def test_train_prints_a_result_table(tmp_path):
    result = runner.invoke(
        app,
        [
            "train",
            "env.total_steps=512",
            f"log.output_dir={tmp_path}",
            "log.tensorboard=false",
            "eval.episodes=2",
            "--seeds",
            "0,1",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "unipg results" in result.output and "over 2 seeds" in result.output
    assert len([path for path in tmp_path.iterdir() if path.is_dir()]) == 2  # one run folder per seed
    assert len(list(tmp_path.glob("ppo-CartPole-v1-seeds-0-1-*.json"))) == 1  # and their aggregate


@pytest.mark.e2e
def test_a_named_run_over_several_seeds_gets_a_folder_per_seed_named_after_it(tmp_path):
    result = runner.invoke(
        app,
        [
            "train",
            "env.total_steps=256",
            f"log.output_dir={tmp_path}",
            "log.tensorboard=false",
            "eval.episodes=1",
            "log.run_name=cartpole",
            "--seeds",
            "0,1",
        ],
    )
    assert result.exit_code == 0, result.output
    assert sorted(path.name for path in tmp_path.iterdir() if path.is_dir()) == ["cartpole-seed0", "cartpole-seed1"]


def test_bad_override_exits_2_with_a_message_and_no_traceback(tmp_path):
    result = runner.invoke(app, ["train", "estimator.clip_rnge=0.1", f"log.output_dir={tmp_path}"])
    assert result.exit_code == 2
    assert "did you mean 'estimator.clip_range'" in result.output
    assert "Traceback" not in result.output
    assert not any(tmp_path.iterdir()), "a rejected config must not create a run"


def test_bad_environment_id_exits_2(tmp_path):
    result = runner.invoke(app, ["train", "env.id=CartPole-v9", f"log.output_dir={tmp_path}"])
    assert result.exit_code == 2 and "CartPole-v1" in result.output


def test_bad_seeds_option():
    result = runner.invoke(app, ["train", "--seeds", "0,x"])
    assert result.exit_code == 2 and "comma-separated integers" in result.output


def test_config_and_algorithms_commands():
    shown = runner.invoke(app, ["config", "algorithm=trpo"])
    assert shown.exit_code == 0 and "policy_loss: trpo" in shown.output
    listed = runner.invoke(app, ["algorithms"])
    assert listed.exit_code == 0 and all(name in listed.output for name in ("ppo", "trpo", "a2c", "reinforce"))


def test_config_command_prints_secrets_redacted_as_a_run_saves_them():
    shown = runner.invoke(app, ["config", "ray.runtime_env={env_vars: {WANDB_API_KEY: abc123secret}}"])
    assert shown.exit_code == 0 and "WANDB_API_KEY" in shown.output and "abc123secret" not in shown.output


def test_algorithms_lists_every_registry_entry_with_its_hyperparameters():
    from unipg.config.presets import ALGORITHMS
    from unipg.estimate import (
        ADVANTAGES,
        KL_ESTIMATORS,
        OFF_POLICY_WEIGHTS,
        POLICY_LOSSES,
    )

    listed = runner.invoke(app, ["algorithms"])
    assert listed.exit_code == 0, listed.output
    output = listed.output
    assert all(name in output for name in ALGORITHMS)
    for registry in (ADVANTAGES, POLICY_LOSSES, OFF_POLICY_WEIGHTS, KL_ESTIMATORS):
        assert all(name in output for name in registry.names())
    # accepted hyperparameters with the defaults of the estimator section, and each entry's summary
    for setting in (
        "clip_range=0.2",
        "clip_range_high=None",
        "dual_clip=None",
        "sample_age_decay=0.99",
        "max_kl=0.01",
        "lambda_gae=0.95",
        "entropy_coef=0.0",
    ):
        assert setting in output
    assert "Generalized advantage estimation" in output


def test_an_unknown_task_option_exits_2_listing_the_accepted_ones():
    result = runner.invoke(app, ["config", "algorithm=grpo", "task.name=arithmetic", "task.options={digts: 3}"])
    assert result.exit_code == 2
    assert "did you mean 'digits'" in result.output and "It accepts: digits, operations" in result.output


@pytest.mark.e2e
def test_eval_scores_the_policy_a_run_saved(embedded_path, tmp_path):
    import json

    from tests.helpers.configs import TWO_EVALUATED_UPDATES as SMALL

    trained = runner.invoke(
        app, ["train", *SMALL, f"model.name={embedded_path}", f"log.output_dir={tmp_path}", "train.updates=1"]
    )
    assert trained.exit_code == 0, trained.output
    run_dir = next(path for path in tmp_path.iterdir() if path.is_dir())
    result = runner.invoke(app, ["eval", "--run", str(run_dir), "eval.pass_k=0", "-o", str(tmp_path / "eval.json")])
    assert result.exit_code == 0, result.output
    assert "greedy" in result.output
    metrics = json.loads((tmp_path / "eval.json").read_text())
    assert 0.0 <= metrics["eval/pass@1"] <= 1.0 and metrics["eval/turns"] == 1.0


def test_eval_of_a_folder_that_is_not_a_run_says_what_to_pass(tmp_path):
    result = runner.invoke(app, ["eval", "--run", str(tmp_path)])
    assert result.exit_code == 2 and "not a finished lm run" in " ".join(result.output.split())
