"""Task, reward and tool options are checked at load time against their registries (``unipg.sample.validate``)."""

from __future__ import annotations

import pytest

from unipg.config import ConfigError, load_config
from unipg.sample.validate import check_sample_options
from unipg.tasks.base import TASKS

TEXT = ["algorithm=grpo", "task.name=arithmetic"]


def check(*overrides: str) -> None:
    check_sample_options(load_config(None, [*TEXT, *overrides]))


def test_an_unknown_task_option_fails_at_load_listing_the_accepted_options():
    with pytest.raises(ConfigError) as error:
        check("task.options={digts: 3}")
    message = str(error.value)
    assert "task.options: task 'arithmetic' has no option 'digts'; did you mean 'digits'?" in message
    assert f"It accepts: {', '.join(TASKS.options('arithmetic'))}" in message


def test_the_accepted_options_are_the_factory_keywords():
    assert TASKS.options("arithmetic") == ["digits", "operations", "num_train", "num_test", "data_seed"]


def test_reward_and_tool_options_and_names_are_checked():
    with pytest.raises(
        ConfigError,
        match=r"task.rewards\[0\]: reward 'math' has no option 'tolerence'; did you mean "
        r"'tolerance'\? It accepts: tolerance",
    ):
        check("task.rewards=[{name: math, options: {tolerence: 0.1}}]")
    with pytest.raises(ConfigError, match=r"task.rewards\[0\]: reward 'length' needs the option\(s\) max_length"):
        check("task.rewards=[{name: length}]")
    with pytest.raises(
        ConfigError, match=r"task.tools\[0\]: tool 'python' has no option 'timout'.*It accepts: timeout"
    ):
        check("task.tools=[{name: python, options: {timout: 3}}]")
    with pytest.raises(ConfigError, match=r"task.tools\[0\]: unknown tool 'calc'; did you mean 'calculator'"):
        check("task.tools=[{name: calc}]")


def test_wrong_types_unknown_tasks_and_stages_are_reported():
    with pytest.raises(ConfigError, match=r"option 'digits' must be int, got str"):
        check("task.options={digits: three}")
    with pytest.raises(ConfigError, match=r"task.name: unknown task 'arithmetc'; did you mean 'arithmetic'"):
        check_sample_options(load_config(None, ["algorithm=grpo", "task.name=arithmetc"]))
    with pytest.raises(ConfigError, match=r"sft.stages\[0\].options: task 'arithmetic' has no option 'digts'"):
        check("sft.stages=[{steps: 1, options: {digts: 2}}]")


def test_valid_options_pass():
    check(
        "task.options={digits: 3}",
        "task.rewards=[{name: math, weight: 1.0, options: {tolerance: 0.01}}]",
        "task.tools=[{name: python, options: {timeout: 3}}]",
    )
    check_sample_options(load_config(None, []))  # gymnasium: nothing to check


def test_a_tool_spec_may_carry_a_simulated_latency_but_no_other_key():
    check("task.tools=[{name: calculator, latency: {kind: lognormal, seconds: 0.2, sigma: 1.0}}]")
    with pytest.raises(ConfigError, match=r"a tool takes only name, options, latency, server, not timeout"):
        check("task.tools=[{name: python, timeout: 5}]")


def test_the_environment_and_its_options_are_checked_against_the_registered_environments():
    check("task.env=tool", "task.env_options={process_weight: 0.2}")
    with pytest.raises(
        ConfigError,
        match=r"task.env: unknown environment 'tools'; did you mean 'tool'\? Valid names: "
        r"gym, single_turn, solver_checker, tool",
    ):
        check("task.env=tools")
    with pytest.raises(
        ConfigError,
        match=r"task.env_options: environment 'tool' has no option 'process_wieght'; did "
        r"you mean 'process_weight'\? It accepts: process_weight, tool_parser",
    ):
        check("task.env=tool", "task.env_options={process_wieght: 0.2}")
    with pytest.raises(ConfigError, match=r"task.env_options are set but task.env is not; name the environment"):
        check("task.env_options={max_rounds: 3}")


def test_the_engine_is_checked_against_the_registered_engines():
    check("sample.engine=vllm")  # accepted, not started
    with pytest.raises(ConfigError, match=r"sample.engine: unknown inference engine 'tgi'.* Valid names: hf, vllm"):
        check("sample.engine=tgi")
