from pathlib import Path

import pytest

from unipg.config import ConfigError, load_config, parse_override

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_come_from_the_algorithm_preset():
    config = load_config(None, ["algorithm=trpo"])
    assert config.estimator.policy_loss == "trpo"
    assert config.train.batch_transitions == 1024


def test_user_value_wins_over_preset():
    config = load_config(None, ["algorithm=ppo", "estimator.clip_range=0.1", "train.num_epochs=3"])
    assert config.estimator.clip_range == 0.1
    assert config.train.num_epochs == 3


def test_yaml_file_and_override(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("algorithm: ppo\nestimator:\n  clip_range: 0.3\ntrain:\n  learning_rate: 1e-4\n")
    config = load_config(path, ["estimator.clip_range=0.15"])
    assert config.estimator.clip_range == 0.15
    assert config.train.learning_rate == 1e-4


def test_seed_reference_loads_unchanged_onto_structured_keys():
    config = load_config(ROOT / "configs" / "seed_reference.yaml")
    assert config.train.learning_rate == 2e-6
    assert config.estimator.clip_range == 0.2
    assert config.estimator.kl_coef == 0.05
    assert config.estimator.entropy_coef == 0.01
    assert config.estimator.gamma == 1.0
    assert config.estimator.lambda_gae == 0.95
    assert (config.train.batch_transitions, config.train.mini_batch_transitions) == (128, 16)  # gym: transitions
    assert (config.sample.rollout_steps, config.sample.replay_buffer_size) == (512, 4096)
    assert config.estimator.sample_age_decay == 0.99
    assert config.train.num_epochs == 4
    assert config.train.max_grad_norm == 1.0
    assert config.estimator.value_loss_coef == 0.5
    assert config.estimator.target_kl == 0.02


def test_keys_the_algorithm_ignores_are_reported_not_silent():
    config = load_config(ROOT / "configs" / "seed_reference.yaml")
    flagged = {warning.split("'")[1] for warning in config.warnings}
    assert {"estimator.kl_coef", "sample.rollout_steps", "estimator.target_kl"} <= flagged
    assert "train.learning_rate" not in flagged
    assert load_config(None, ["algorithm=ppo", "estimator.clip_range=0.1"]).warnings == []
    assert any("clip_range" in w for w in load_config(None, ["algorithm=a2c", "estimator.clip_range=0.1"]).warnings)


def test_unknown_key_suggests_the_nearest():
    with pytest.raises(ConfigError, match=r"unknown key 'estimator.clip_rnge'; did you mean 'estimator.clip_range'"):
        load_config(None, ["estimator.clip_rnge=0.1"])
    with pytest.raises(ConfigError, match=r"did you mean 'estimator.clip_range'"):
        load_config(None, ["train.clip_range=0.1"])  # right leaf, wrong section


def test_cross_field_rule_says_how_to_fix():
    with pytest.raises(
        ConfigError, match=r"train.mini_batch_transitions \(100\) must divide train.batch_transitions \(256\)"
    ):
        load_config(None, ["algorithm=ppo", "train.mini_batch_transitions=100"])
    with pytest.raises(ConfigError, match=r"env.num_envs \(3\) must divide"):
        load_config(None, ["algorithm=ppo", "env.num_envs=3"])


def test_type_and_range_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"'estimator.clip_range'.*'abc'"):
        load_config(None, ["estimator.clip_range=abc"])
    with pytest.raises(ConfigError, match=r"'estimator.gamma'"):
        load_config(None, ["estimator.gamma=1.5"])


def test_every_problem_is_listed_at_once():
    with pytest.raises(ConfigError) as error:
        load_config(None, ["train.mini_batch_transitions=100", "estimator.advantage=gea"])
    assert "mini_batch_transitions" in str(error.value) and "did you mean 'gae'" in str(error.value)


def test_unknown_algorithm_and_registry_names():
    with pytest.raises(ConfigError, match=r"unknown algorithm 'ppp'; did you mean 'ppo'"):
        load_config(None, ["algorithm=ppp"])
    with pytest.raises(ConfigError, match=r"unknown policy loss 'ppo2'.*Valid names"):
        load_config(None, ["estimator.policy_loss=ppo2"])
    with pytest.raises(ConfigError, match=r"off-policy weight"):
        load_config(None, ["estimator.off_policy_weight=age"])


def test_group_estimators_are_rejected_for_gym_environments():
    with pytest.raises(ConfigError, match=r"'grpo' works on groups"):
        load_config(None, ["estimator.advantage=grpo"])
    with pytest.raises(
        ConfigError,
        match=r"'reinforce_plus_plus' does not read episode ends .*use one of: "
        r"batch_mean_baseline, gae, reward_to_go, td, value_baseline$",
    ):
        load_config(None, ["estimator.advantage=reinforce_plus_plus"])


def test_flat_and_structured_key_together_is_an_error():
    with pytest.raises(ConfigError, match=r"'learning_rate' and 'train.learning_rate' are both set"):
        load_config(None, ["learning_rate=1e-3", "train.learning_rate=1e-4"])


def test_adaptive_kl_needs_a_target():
    with pytest.raises(ConfigError, match=r"target_kl"):
        load_config(None, ["estimator.kl_control=adaptive"])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_config(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("algorithm: [ppo\n")
    with pytest.raises(ConfigError, match=r"not valid YAML"):
        load_config(broken)
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match=r"must hold a mapping"):
        load_config(listing)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"algorithm: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"UTF-8"):
        load_config(binary)
    section = tmp_path / "section.yaml"
    section.write_text("estimator: 3\n")
    with pytest.raises(ConfigError, match=r"'estimator' is a section"):
        load_config(section)


def test_parse_override():
    assert parse_override("estimator.clip_range=0.1") == ("estimator.clip_range", 0.1)
    assert parse_override("policy.hidden_sizes=[32, 32]") == ("policy.hidden_sizes", [32, 32])
    assert parse_override("train.max_grad_norm=null") == ("train.max_grad_norm", None)
    assert parse_override("env.id=CartPole-v1") == ("env.id", "CartPole-v1")
    with pytest.raises(ConfigError, match=r"key=value"):
        parse_override("estimator.clip_range")


def test_hyperparameters_of_an_unchosen_option_are_reported():
    warnings = load_config(None, ["estimator.is_truncation=1.5", "estimator.sample_age_decay=0.9"]).warnings
    assert any("is_truncation" in w and "off_policy_weight is truncated_is" in w for w in warnings)
    assert any("sample_age_decay" in w for w in warnings)
    chosen = load_config(None, ["estimator.off_policy_weight=truncated_is", "estimator.is_truncation=1.5"])
    assert chosen.warnings == []
    assert any(
        "lambda_gae" in w for w in load_config(None, ["estimator.advantage=td", "estimator.lambda_gae=0.9"]).warnings
    )


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda path: path.name)
def test_every_shipped_config_loads_and_builds_its_task(path):
    from unipg.tasks.base import make_task

    config = load_config(path)
    if config.task.name:
        make_task(config.task.name, **config.task.options)
        for stage in config.sft.stages:
            make_task(config.task.name, **{**config.task.options, **stage.options})


def test_batch_sizes_carry_their_unit_per_mode():
    gym = load_config(None, ["algorithm=ppo", "train.batch_transitions=512", "train.mini_batch_transitions=128"])
    assert (gym.train.batch_transitions, gym.train.mini_batch_transitions, gym.steps_per_env) == (512, 128, 64)
    assert gym.warnings == []
    lm = load_config(
        None, ["task.name=arithmetic", "algorithm=grpo", "train.batch_size=32", "train.mini_batch_size=16"]
    )
    assert (lm.train.batch_size, lm.train.mini_batch_size, lm.prompts_per_step) == (32, 16, 4)
    misplaced = load_config(None, ["task.name=arithmetic", "algorithm=grpo", "train.batch_transitions=32"])
    assert any("'train.batch_transitions' has no effect" in warning for warning in misplaced.warnings)


def test_a_gym_run_reads_the_old_batch_keys_as_transitions_with_a_deprecation_warning():
    config = load_config(None, ["algorithm=ppo", "train.batch_size=256", "train.mini_batch_size=32"])
    assert (config.train.batch_transitions, config.train.mini_batch_transitions) == (256, 32)
    assert [w for w in config.warnings if "rename the key" in w] == [
        "'train.batch_size' counts completions in language-model runs; a gymnasium run counts its batch in "
        "environment transitions: read as 'train.batch_transitions' (256); rename the key",
        "'train.mini_batch_size' counts completions in language-model runs; a gymnasium run counts its batch in "
        "environment transitions: read as 'train.mini_batch_transitions' (32); rename the key",
    ]


def test_an_lm_run_that_would_choose_its_best_checkpoint_on_the_test_split_is_warned():
    assert load_config(None, ["task.name=arithmetic"]).checkpoint.best_metric == "val/pass@1"
    assert load_config(None, ["task.name=arithmetic"]).warnings == []
    warned = load_config(None, ["task.name=arithmetic", "checkpoint.best_metric=eval/pass@1"]).warnings
    assert any("test split" in w and "checkpoint.best_metric=val/pass@1" in w for w in warned)
    off = ["task.name=arithmetic", "checkpoint.best_metric=eval/pass@1", "checkpoint.keep_best=false"]
    assert load_config(None, off).warnings == []
    assert load_config(None, ["env.id=CartPole-v1", "checkpoint.best_metric=eval/return_mean"]).warnings == []
