"""Multi-turn layout with the stock templates of each model family: an episode's tokens are exactly the tokens of
the conversation its chat template renders, and each family's tool calls reach the tool."""

import asyncio

import pytest

from tests.helpers.scripted import ScriptedEngine
from unipg.envs import EnvironmentService
from unipg.envs.tool_env import ToolEnv
from unipg.policy.chat import TurnTemplate
from unipg.policy.templates import family_tokenizer, prepare_chat_template, read_template
from unipg.policy.tool_calls import parser_for_template, tool_parser
from unipg.sample.agent import AgentLoop
from unipg.sample.episodes import PromptEncoder
from unipg.tasks.base import Example
from unipg.tasks.rewards.rules import build_rewards

SYSTEM, QUESTION = "You add numbers with the calculator.", "What is 19+23?"
REASONING = {"qwen3": ("<think>\nI should use the calculator.\n</think>\n\n", "<think>\nIt said 42.\n</think>\n\n")}


def run_episode(tokenizer, parser_name, turns):
    service = EnvironmentService.from_specs([{"name": "calculator"}])
    schemas = [tool.schema() for tool in service.tools.values()]
    engine = ScriptedEngine(tokenizer, turns, keep_stop=tool_parser(parser_name).stop)
    template = TurnTemplate(tokenizer)
    loop = AgentLoop(
        engine,
        template,
        PromptEncoder(tokenizer, system_prompt=SYSTEM, max_length=10_000, tools=schemas),
        max_turns=3,
        max_new_tokens=200,
        max_total_tokens=2000,
    )
    env = ToolEnv(build_rewards([{"name": "math"}]), service, tool_parser=parser_name)
    [trajectory] = asyncio.run(loop.run_episodes([env], [Example(QUESTION, "42", "", {"answer": "42"})]))
    return trajectory, template, schemas


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3", "llama3.1", "llama3.2"])
def test_an_episode_is_token_for_token_the_conversation_its_template_renders(family):
    tokenizer = family_tokenizer(family)
    tokenizer.model_max_length = 10_000  # one token per character: the tool descriptions alone pass 512
    if family == "qwen3":
        with pytest.warns(UserWarning, match="qwen3-training"):
            prepare_chat_template(tokenizer, model=family)
    parser_name = parser_for_template(tokenizer.chat_template)
    assert parser_name == ("llama3_json" if family.startswith("llama") else "hermes")
    think_first, think_last = REASONING.get(family, ("", ""))
    call = think_first + tool_parser(parser_name).format_tool_call("calculator", {"expression": "19+23"})
    answer = think_last + "The answer is 42."
    trajectory, template, schemas = run_episode(tokenizer, parser_name, [call, answer])

    assert trajectory.infos[0].tool_status == "ok" and trajectory.correct and trajectory.finish == "done"
    conversation = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": answer},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tools=schemas, tokenize=False)
    expected = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    episode = trajectory.prompt_ids + trajectory.token_ids
    assert episode == expected[: len(episode)]
    assert tokenizer.decode(expected[len(episode) :]) == template.closing(ended_with_eos=True)  # the last turn's close
    sampled = [token for token, mask in zip(trajectory.token_ids, trajectory.loss_mask) if mask]
    call_end = "" if parser_name == "hermes" else tokenizer.eos_token  # sampling stops at </tool_call>; Llama's at EOS
    assert tokenizer.decode(sampled) == call + call_end + answer + tokenizer.eos_token


def test_qwen3_training_variant_prompts_exactly_as_the_stock_template():
    stock, variant = family_tokenizer("qwen3"), family_tokenizer("qwen3", read_template("qwen3-training"))
    schemas = EnvironmentService.from_specs([{"name": "calculator"}]).tools["calculator"].schema()
    for tokenizer in (stock, variant):
        tokenizer.prompt = PromptEncoder(tokenizer, system_prompt=SYSTEM, max_length=10_000, tools=[schemas])(QUESTION)
    assert stock.prompt == variant.prompt
