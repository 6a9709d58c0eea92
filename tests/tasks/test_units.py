"""The units task: a tool with a number and two closed-vocabulary words, its demonstrations and rewards."""

import asyncio
import re

import pytest

from unipg.config import load_config
from unipg.envs.service import EnvironmentService
from unipg.envs.tool_env import parse_turn
from unipg.observe.metrics import read_metrics
from unipg.policy.loading import load_lm_policy
from unipg.runtime.lm import train_lm
from unipg.sample.episodes import EpisodeRunner
from unipg.tasks.base import make_task
from unipg.tasks.rewards.rules import build_rewards
from unipg.tasks.units import PHRASINGS
from unipg.tools.base import TOOLS, ToolError
from unipg.tools.units import UNITS, convert_value

SMALL = {"digits": 2, "num_train": 300, "num_test": 40}


def test_examples_are_whole_number_conversions_in_several_phrasings_with_a_disjoint_test_split():
    task = make_task("units", **SMALL, tool_demonstrations=0.5)
    assert (len(task.train) + len(task.validation), len(task.test)) == (300, 40) and task.tools == [{"name": "convert"}]
    assert not {e.prompt for e in task.train} & {e.prompt for e in task.test}
    patterns = [
        re.escape(p)
        .replace(r"\{value\}", r"(?P<value>\d+)")
        .replace(r"\{source\}", r"(?P<source>\w+)")
        .replace(r"\{target\}", r"(?P<target>\w+)")
        for p in PHRASINGS
    ]
    used = set()
    for example in task.train + task.test:
        index, match = next(
            (i, re.fullmatch(p, example.prompt)) for i, p in enumerate(patterns) if re.fullmatch(p, example.prompt)
        )
        used.add(index)
        source, target = match["source"], match["target"]
        assert example.answer == str(int(match["value"]) * int(UNITS[source][1] / UNITS[target][1]))
    assert used == set(range(len(PHRASINGS)))
    assert all(len(e.solution) == 3 for e in task.test)  # held-out references all show the tool
    assert 0.35 < sum(len(e.solution) == 3 for e in task.train) / len(task.train) < 0.65
    assert [e.prompt for e in make_task("units", **SMALL).test] == [
        e.prompt for e in make_task("units", **{**SMALL, "num_train": 100}).test
    ]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"digits": 0}, "digits"),
        ({"process_reward": 0.9}, "process_reward"),
        ({"digits": 1, "num_test": 500}, "distinct problems"),
    ],
)
def test_bad_options_say_what_to_change(options, message):
    with pytest.raises(ValueError, match=message):
        make_task("units", **options)


def test_the_tool_converts_exactly_and_refuses_what_it_cannot():
    tool = TOOLS.get("convert")()
    assert tool.function(value=347, from_unit="km", to_unit="m") == "347000"
    assert tool.function(value=3, from_unit="ft", to_unit="in") == "36"
    assert (
        tool.function(value=1, from_unit="in", to_unit="cm") == "2.54"
        and convert_value(1, "lb", "g") * 100_000 == 45359237
    )
    with pytest.raises(ToolError, match="cannot convert length"):
        tool.function(value=1, from_unit="km", to_unit="kg")
    properties = tool.schema()["function"]["parameters"]["properties"]
    assert properties["value"]["type"] == "number" and "km" in properties["from_unit"]["enum"]
    assert "must be one of" in tool.check_arguments({"value": 1, "from_unit": "parsec", "to_unit": "m"})
    assert "must be number" in tool.check_arguments({"value": "1", "from_unit": "km", "to_unit": "m"})


def test_every_tool_demonstration_is_a_valid_call_whose_result_is_the_answer():
    task = make_task("units", **SMALL, tool_demonstrations=1.0)
    service = EnvironmentService.from_specs(task.tools)
    try:
        for example in task.train[:50]:
            call, result, answer = example.solution
            turn = parse_turn(call["content"], service)
            assert turn.kind == "call" and turn.name == "convert"
            assert service.tools["convert"].function(**turn.arguments) == result["content"] == answer["content"]
            assert answer["content"] == example.answer
    finally:
        service.close()


def episode_rewards(embedded_path, process_reward, turns):
    task = make_task("units", **SMALL, process_reward=process_reward)
    config = load_config(None, ["task.name=units", "log.progress=false"])
    runner = EpisodeRunner(load_lm_policy(embedded_path), task, config, build_rewards(task.rewards))
    example = task.test[0]

    async def play():
        env = runner.make_env()
        await env.reset(example)
        return [await env.step(example.answer if text == "ANSWER" else text) for text in turns]

    try:
        return asyncio.run(play()), example
    finally:
        runner.close()


def test_rewards_pay_the_answer_and_the_tasks_process_reward_for_a_call_the_tool_answers(embedded_path):
    good_call = make_task("units", **SMALL).test[0].solution[0]["content"]
    (call, answer), example = episode_rewards(embedded_path, 0.15, [good_call, "ANSWER"])
    assert call.reward == pytest.approx(0.15) and call.observation == example.answer and call.info.tool_status == "ok"
    assert answer.done and answer.reward == 1.0 and answer.info.correct
    (bad,), _ = episode_rewards(embedded_path, 0.15, [good_call.replace('"from_unit": "', '"from_unit": "x')])
    assert bad.info.tool_status == "malformed" and bad.reward == pytest.approx(-0.15)
    (call, wrong), _ = episode_rewards(embedded_path, 0.0, [good_call, "7"])
    assert call.reward == 0.0 and wrong.reward == 0.0 and not wrong.info.correct


@pytest.mark.e2e
def test_the_units_config_trains_two_updates(embedded_path, tmp_path):
    config = load_config(
        "configs/units_agent.yaml",
        [
            f"model.name={embedded_path}",
            "model.warm_start=false",
            "task.options={digits: 1, num_train: 16, num_test: 4}",
            "train.updates=2",
            "train.batch_size=8",
            "train.mini_batch_size=8",
            "train.micro_batch_size=8",
            "sample.samples_per_prompt=4",
            "sample.max_new_tokens=16",
            "agent.max_total_tokens=40",
            "eval.every_updates=1",
            f"log.output_dir={tmp_path}",
            "log.progress=false",
            "log.tensorboard=false",
        ],
    )
    result = train_lm(config)
    assert result.updates == 2 and len(result.eval_history) == 3
    assert sum("rollout/reward_mean" in record for record in read_metrics(result.run_dir)) == 2
