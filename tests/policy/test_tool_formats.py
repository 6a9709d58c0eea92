"""Tool-call formats per model family: hermes (Qwen) and llama3_json (Llama 3.x), chosen from the chat template."""

import pytest
import torch

from unipg.config import ConfigError, load_config
from unipg.policy.embedded import build_model
from unipg.policy.lm import LMPolicy
from unipg.policy.templates import family_tokenizer, read_template
from unipg.policy.tool_calls import (
    TOOL_PARSERS,
    MalformedToolCall,
    ToolCall,
    parse_tool_calls,
    parser_for_template,
    rewrite_calls,
    tool_parser,
)
from unipg.sample.episodes import EpisodeRunner
from unipg.sample.validate import check_sample_options
from unipg.tasks.base import make_task
from unipg.tasks.rewards.rules import build_rewards


@pytest.mark.parametrize(
    "text, calls",
    [
        ("The answer is 4.", []),
        (
            'Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
            [ToolCall("add", {"a": 1, "b": 2})],
        ),
        (
            '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>',
            [ToolCall("a", {}), ToolCall("b", {"x": 1})],
        ),
        (
            '<tool_call>{"name": "py", "arguments": {"code": "print(\'</tool_call>\')"}}</tool_call>',
            [ToolCall("py", {"code": "print('</tool_call>')"})],
        ),
    ],
)
def test_hermes_calls_are_json_between_tags(text, calls):
    assert parse_tool_calls(text, "hermes") == calls


@pytest.mark.parametrize(
    "text, calls",
    [
        ("The answer is 4.", []),
        ("{curly} braces in an answer", []),
        ('{"name": "add", "parameters": {"a": 1, "b": 2}}', [ToolCall("add", {"a": 1, "b": 2})]),
        ('<|python_tag|>{"name": "add", "parameters": {"a": 1}}', [ToolCall("add", {"a": 1})]),
        (
            '{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}',
            [ToolCall("a", {}), ToolCall("b", {"x": 1})],
        ),
    ],
)
def test_llama3_calls_are_the_turn_as_json_with_parameters(text, calls):
    assert parse_tool_calls(text, "llama3_json") == calls


@pytest.mark.parametrize(
    "parser, text, problem",
    [
        ("hermes", '<tool_call>{"name": "add"', "no closing </tool_call>"),
        ("hermes", "<tool_call>[1, 2]</tool_call>", 'must be {"name": "<tool>", "arguments": {...}}'),
        ("llama3_json", '{"name": "add", "parameters": {"a": ', "not valid JSON"),
        ("llama3_json", "<|python_tag|>add(1, 2)", "after <|python_tag|> the call must be"),
        ("llama3_json", '{"tool": "add"}', 'must be {"name": "<tool>", "parameters": {...}}'),
    ],
)
def test_a_call_that_cannot_be_read_says_what_is_wrong(parser, text, problem):
    with pytest.raises(
        MalformedToolCall, match=problem.replace("{", r"\{").replace("[", r"\[").replace("(", r"\(").replace("|", r"\|")
    ):
        parse_tool_calls(text, parser)


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_a_formatted_call_parses_back(parser):
    arguments = {"expression": "19+23", "nested": {"list": [1, "two", None]}}
    assert parse_tool_calls(tool_parser(parser).format_tool_call("calc", arguments), parser) == [
        ToolCall("calc", arguments)
    ]


def test_demonstrations_written_with_hermes_calls_are_rewritten_per_family():
    turn = 'I will add. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    assert rewrite_calls(turn, "hermes") == turn
    assert rewrite_calls(turn, "llama3_json") == '{"name": "add", "parameters": {"a": 1}}'
    assert rewrite_calls("The answer is 1.", "llama3_json") == "The answer is 1."


def test_the_format_is_chosen_from_the_chat_template():
    assert [parser_for_template(read_template(name)) for name in ("qwen2.5", "qwen3", "llama3.1", "llama3.2")] == [
        "hermes",
        "hermes",
        "llama3_json",
        "llama3_json",
    ]
    assert parser_for_template(None) == "hermes"
    assert TOOL_PARSERS.names() == ["hermes", "llama3_json"]


def tiny_policy(family: str) -> LMPolicy:
    tokenizer = family_tokenizer(family)
    return LMPolicy(build_model(tokenizer), tokenizer)


def test_episodes_read_calls_in_the_family_format_unless_model_tool_parser_says_otherwise():
    torch.manual_seed(0)
    task, policy = make_task("calculator"), tiny_policy("llama3.1")
    reward = build_rewards(task.rewards)
    runner = EpisodeRunner(policy, task, load_config(None, ["task.name=calculator"]), reward)
    assert runner.tool_parser == "llama3_json" and "</tool_call>" not in (runner.sampling().stop or [])
    assert runner.make_env().parser.parse_tool_calls('{"name": "calculator", "parameters": {}}')
    config = load_config(None, ["task.name=calculator", "model.tool_parser=hermes"])
    check_sample_options(config)
    overridden = EpisodeRunner(policy, task, config, reward)
    assert overridden.tool_parser == "hermes" and "</tool_call>" in overridden.sampling().stop
    runner.close(), overridden.close()


def test_an_unknown_tool_parser_is_a_config_error_listing_the_known_ones():
    with pytest.raises(ConfigError, match="model.tool_parser: unknown tool parser 'mistral'.*hermes, llama3_json"):
        check_sample_options(load_config(None, ["task.name=calculator", "model.tool_parser=mistral"]))


def test_sft_demonstrations_call_tools_in_the_format_of_the_models_family():
    from unipg.sample.episodes import demonstration_pairs

    task = make_task("calculator", digits=2, num_train=4, num_test=2, tool_demonstrations=1.0)
    config = load_config(None, ["task.name=calculator", "agent.tool_prompt=false"])
    [(prompt, segments), *_] = demonstration_pairs(family_tokenizer("llama3.1"), task, config, task.train)
    first_turn = segments[0][0]
    assert first_turn.startswith('{"name": "calculator", "parameters": {"expression": ')
    assert first_turn.endswith("}<|eot_id|>") and segments[0][1]  # trained, EOS included
    assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
