"""What an environment reports of a turn is a ``TurnInfo``; an environment written against the earlier protocol,
whose step returns a plain dict as info, still plays episodes."""

import asyncio

import pytest

from tests.helpers.scripted import ScriptedEngine
from unipg.envs import StepResult, TurnInfo
from unipg.policy.chat import TurnTemplate
from unipg.policy.templates import family_tokenizer
from unipg.sample.agent import AgentLoop
from unipg.tasks.base import Example


class DictInfoEnv:
    """A plugin environment of the earlier protocol: a tool call, then the final answer, reported as dicts."""

    observation_role = "tool"

    def __init__(self, final_info):
        self.turns, self.final_info = 0, final_info

    async def reset(self, example):
        return example.prompt

    async def step(self, action):
        self.turns += 1
        if self.turns == 1:
            return StepResult("42", 0.1, False, {"tool": "lookup", "tool_status": "ok", "cache_hit": True})
        return StepResult("", 1.0, True, self.final_info)


def play(env):
    tokenizer = family_tokenizer("qwen2.5")
    tokenizer.model_max_length = 10_000
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    loop = AgentLoop(
        ScriptedEngine(tokenizer, ["call", "42"]),
        TurnTemplate(tokenizer),
        encode,
        max_turns=3,
        max_new_tokens=50,
        max_total_tokens=500,
    )
    [trajectory] = asyncio.run(loop.run_episodes([env], [Example("What is 6*7?", "42", "")]))
    return trajectory


def test_a_plugin_environment_that_reports_dicts_plays_episodes_with_its_facts_read_as_fields():
    trajectory = play(DictInfoEnv({"final": True, "correct": True, "reward_terms": {"math": 1.0}}))
    call, answer = trajectory.infos
    assert call == TurnInfo(tool="lookup", tool_status="ok", extras={"cache_hit": True})
    assert answer.final and answer.reward_terms == {"math": 1.0} and answer.extras == {}
    assert trajectory.correct and trajectory.tool_calls == 1 and trajectory.tool_status_count("ok") == 1


@pytest.mark.parametrize(
    "info, problem",
    [
        (["final"], "returned info of type list; return a unipg.envs.TurnInfo"),
        ({"final": True, "reward_terms": 1.0}, "reward_terms of type float; it must map names to numbers"),
    ],
)
def test_an_info_of_another_shape_is_refused_saying_what_to_return(info, problem):
    with pytest.raises(TypeError, match=problem):
        play(DictInfoEnv(info))


def test_a_step_that_reports_nothing_has_the_empty_turn_info():
    assert StepResult("observation", 0.0, False).info == TurnInfo() == TurnInfo.of(None)
    assert not TurnInfo().final and TurnInfo().tool_status is None and TurnInfo().reward_terms is None
