"""``agent.role_policy: separate`` (a model per role): what this version does not run is refused when the config
loads, with what to set instead, never a traceback from deep inside a run."""

from pathlib import Path

import pytest

from unipg.config import ConfigError, load_config

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "solver_checker.yaml"
SEPARATE = ["model.warm_start=false", "agent.role_policy=separate"]


def test_a_model_per_role_loads_with_a_role_naming_its_own_model():
    config = load_config(CONFIG, [*SEPARATE, "agent.roles.checker.model=embedded"])
    assert config.agent.role_policy == "separate"
    assert config.agent.roles["checker"].model == "embedded"
    assert config.agent.roles["checker"].shaping == 0.0  # the file's own setting for the role stays


@pytest.mark.parametrize(
    ("setting", "refused", "instead"),
    [
        ("train.learner_processes=2", "train.learner_processes=2", "set train.learner_processes=1"),
        ("model.value_head=true", "a value head or critic model", "set model.value_head=false"),
        ("model.lora_rank=4", "model.lora_rank=4", "agent.role_policy=adapters"),
    ],
)
def test_what_does_not_run_with_a_model_per_role_is_refused_with_the_fix(setting, refused, instead):
    with pytest.raises(ConfigError) as error:
        load_config(CONFIG, [*SEPARATE, *setting.split()])
    message = str(error.value)
    assert f"agent.role_policy=separate (a model per role) does not run with {refused}" in message
    assert instead in message and "or agent.role_policy=shared" in message


@pytest.mark.parametrize(
    "setting",
    [
        "backend=ray",
        "sample.engine=vllm runtime.max_staleness=0",
        "sample.engine=vllm runtime.max_staleness=1",
        "sample.engine=vllm backend=ray runtime.max_staleness=1",
    ],
)
def test_a_model_per_role_loads_on_ray_and_on_vllm(setting):
    assert load_config(CONFIG, [*SEPARATE, *setting.split()]).agent.role_policy == "separate"


def test_a_roles_model_without_separate_is_refused():
    with pytest.raises(ConfigError, match="agent.roles.checker.model is read with agent.role_policy=separate only"):
        load_config(CONFIG, ["model.warm_start=false", "agent.roles.checker.model=embedded"])


def test_a_one_role_task_and_another_tokenizer_are_refused_when_the_models_load(tmp_path):
    from unipg.policy.loading import policy_from_config

    one_role = load_config(None, ["task.name=arithmetic", "algorithm=grpo", "agent.role_policy=separate"])
    with pytest.raises(ConfigError, match="task 'arithmetic' has one role; set agent.role_policy=shared"):
        policy_from_config(one_role, [])
    mixed = load_config(CONFIG, [*SEPARATE, "model.name=embedded", "agent.roles.checker.model=embedded:tiny-numbers"])
    with pytest.raises(ValueError, match="the model of role 'checker' has another tokenizer than the run's"):
        policy_from_config(mixed, ["solver", "checker"])
