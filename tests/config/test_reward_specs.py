"""Rewards take the shape of tasks and tools, ``{name, weight, options: {...}}``; the older form with options
beside the name still works, with a warning that shows the entry in the new form."""

import warnings

import pytest

from unipg import UnipgDeprecationWarning
from unipg.config import ConfigError, load_config
from unipg.config.specs import reward_spec
from unipg.sample.validate import check_sample_options
from unipg.tasks.rewards.rules import build_rewards

TEXT = ["algorithm=grpo", "task.name=arithmetic"]
NESTED = {"name": "length", "weight": 0.1, "options": {"max_length": 120}}


def test_the_nested_form_loads_without_a_warning_and_is_stored_as_written():
    config = load_config(
        None, [*TEXT, "task.rewards=[{name: math}, {name: length, weight: 0.1, options: {max_length: 120}}]"]
    )
    check_sample_options(config)
    assert config.task.rewards == [{"name": "math"}, NESTED]
    assert config.warnings == []


def test_options_beside_the_name_load_in_the_nested_form_with_a_warning_showing_it():
    config = load_config(None, [*TEXT, "task.rewards=[{name: math}, {name: length, weight: 0.1, max_length: 120}]"])
    check_sample_options(config)
    assert config.task.rewards == [{"name": "math"}, NESTED]
    assert config.warnings == [
        "task.rewards[1]: a reward's options go under 'options'; write {name: length, "
        "weight: 0.1, options: {max_length: 120}} (options beside the name are read until "
        "the next release)"
    ]


def test_an_option_set_in_both_places_or_options_that_are_no_mapping_are_errors():
    with pytest.raises(
        ConfigError,
        match=r"task.rewards\[0\] sets max_length both beside the name and under "
        r"options; keep the one under options",
    ):
        load_config(None, [*TEXT, "task.rewards=[{name: length, max_length: 9, options: {max_length: 120}}]"])
    with pytest.raises(ConfigError, match=r"task.rewards\[0\].options must be a mapping of option names to values"):
        check_sample_options(load_config(None, [*TEXT, "task.rewards=[{name: length, options: 120}]"]))
    with pytest.raises(ConfigError, match=r"task.rewards\[0\]: reward 'math' has no option 'tol'"):
        check_sample_options(load_config(None, [*TEXT, "task.rewards=[{name: math, options: {tol: 0.1}}]"]))


def test_an_entry_without_options_is_already_in_the_nested_form():
    assert reward_spec({"name": "math", "weight": 2.0}, "task.rewards[0]") == ({"name": "math", "weight": 2.0}, None)
    assert reward_spec("math", "task.rewards[0]") == ("math", None)  # not a mapping: the caller's check reports it


def test_build_rewards_reads_both_forms_alike_and_warns_about_the_inline_one():
    prompts, completions, answers = ["q", "q"], ["#### 4", "#### 4, as the long tail says"], ["4", "4"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nested = build_rewards([{"name": "math"}, {"name": "length", "weight": 0.5, "options": {"max_length": 10}}])
    with pytest.warns(
        UnipgDeprecationWarning,
        match=r"rewards\[1\]: a reward's options go under 'options'; write "
        r"\{name: length, weight: 0.5, options: \{max_length: 10\}\}",
    ):
        inline = build_rewards([{"name": "math"}, {"name": "length", "weight": 0.5, "max_length": 10}])
    scored = nested(prompts, completions, answer=answers).total
    assert scored[0] == 1.0 and scored[1] < 1.0  # the long completion pays the length penalty
    assert inline(prompts, completions, answer=answers).total == scored
    with pytest.raises(ValueError, match=r"reward 'length': options must be a mapping"):
        build_rewards([{"name": "length", "options": [120]}])
