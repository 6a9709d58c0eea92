import asyncio
import json
import time

import pytest

from unipg.envs import ENVS, EnvironmentService
from unipg.envs.tool_env import ToolEnv, parse_turn
from unipg.tasks.base import Example
from unipg.tasks.rewards.rules import build_rewards
from unipg.tools import LatencyModel, ToolError, tool


def make_service(**options):
    calls = {"flaky": 0}

    @tool
    def echo(text: str) -> str:
        """Repeat the text."""
        return text

    @tool
    def raises(text: str) -> str:
        """Always fails."""
        raise RuntimeError("backend down")

    @tool
    def hangs(text: str) -> str:
        """Never answers in time."""
        time.sleep(2.0)
        return text

    @tool
    def garbage(text: str) -> str:
        """Returns something that is not text."""
        return object()

    @tool
    def refuses(text: str) -> str:
        """Refuses the call."""
        raise ToolError("cannot do that")

    @tool
    def flaky(text: str) -> str:
        """Fails once, then works."""
        calls["flaky"] += 1
        if calls["flaky"] == 1:
            raise ConnectionError("transient")
        return "ok " + text

    tools = {t.name: t for t in (echo, raises, hangs, garbage, refuses, flaky)}
    defaults = dict(timeout=0.2, retries=1, backoff=0.01, default_observation="tool unavailable", failure_penalty=0.5)
    return EnvironmentService(tools, **{**defaults, **options}), calls


def call(service, name, arguments):
    return asyncio.run(service.call(name, arguments))


@pytest.mark.parametrize("name", ["raises", "hangs", "garbage"])
def test_a_failing_tool_yields_the_default_observation_and_the_penalty(name):
    service, _ = make_service()
    start = time.monotonic()
    result = call(service, name, {"text": "x"})
    assert result.status == "failed" and result.observation == "tool unavailable" and result.penalty == -0.5
    assert result.attempts == 2  # one retry
    assert time.monotonic() - start < 2.0  # a hanging tool costs the timeout per attempt, not its own 2 s
    if name == "hangs":
        assert result.timeouts == 2 and service.stats.timeouts == 2


def test_a_transient_failure_is_retried_with_backoff():
    service, calls = make_service()
    result = call(service, "flaky", {"text": "x"})
    assert result.ok and result.observation == "ok x" and result.attempts == 2 and calls["flaky"] == 2
    assert service.pop_stats().retries == 1 and service.stats.calls == 0


def test_a_refusal_is_shown_to_the_agent_and_not_retried():
    service, _ = make_service()
    result = call(service, "refuses", {"text": "x"})
    assert result.status == "error" and result.observation == "error: cannot do that"
    assert result.attempts == 1 and result.penalty == 0.0


def test_long_output_is_clipped():
    service, _ = make_service(max_output_chars=10)
    assert call(service, "echo", {"text": "a" * 25}).observation == "a" * 10 + "... [15 more characters]"


def test_latency_counts_against_the_timeout():
    service, _ = make_service()
    service.tools["echo"].latency = LatencyModel("fixed", 1.0)
    assert call(service, "echo", {"text": "x"}).status == "failed"


def test_tools_run_concurrently():
    service, _ = make_service(timeout=2.0)
    service.tools["echo"].latency = LatencyModel("fixed", 0.3)

    async def timed(text: str):
        start = time.monotonic()
        result = await service.call("echo", {"text": text})
        return result, start, time.monotonic()

    async def many():
        return await asyncio.gather(*(timed(str(i)) for i in range(10)))

    results = asyncio.run(many())
    assert [r.observation for r, _, _ in results] == [str(i) for i in range(10)]
    assert max(start for _, start, _ in results) < min(end for _, _, end in results)  # all ten ran at once


@pytest.mark.parametrize(
    "text, problem",
    [
        ('<tool_call>{"name": "echo", "arguments": {"text": "x"}}', "no closing"),
        ('<tool_call>{"name": echo}</tool_call>', "not valid JSON"),
        ('<tool_call>["echo"]</tool_call>', '"name"'),
        ('<tool_call>{"name": "mystery", "arguments": {}}</tool_call>', "unknown tool 'mystery'"),
        ('<tool_call>{"name": "echo", "arguments": {"txt": "x"}}</tool_call>', "unknown argument"),
        ('<tool_call>{"name": "echo", "arguments": {"text": 5}}</tool_call>', "must be string"),
    ],
)
def test_malformed_calls_say_what_was_wrong(text, problem):
    service, _ = make_service()
    turn = parse_turn(text, service)
    assert turn.kind == "malformed" and problem in turn.error


def test_a_turn_without_a_call_is_the_answer():
    service, _ = make_service()
    assert parse_turn("The answer is 42.", service).kind == "answer"
    call_turn = parse_turn('I will check. <tool_call>{"name": "echo", "arguments": {"text": "x"}}</tool_call>', service)
    assert (call_turn.kind, call_turn.name, call_turn.arguments) == ("call", "echo", {"text": "x"})


def run_episode(env, example, actions):
    async def play():
        observations = [await env.reset(example)]
        steps = []
        for action in actions:
            steps.append(await env.step(action))
            if steps[-1].done:
                break
        return observations, steps

    return asyncio.run(play())


def test_tool_env_episode_rewards_process_and_final_answer():
    service, _ = make_service()
    env = ToolEnv(build_rewards([{"name": "math"}]), service, process_weight=0.1)
    example = Example("What is 6*7?", "42", "", {"answer": "42"})
    good = '<tool_call>{"name": "echo", "arguments": {"text": "42"}}</tool_call>'
    first, steps = run_episode(
        env,
        example,
        [
            "<tool_call>oops</tool_call>",
            good,
            good,
            '<tool_call>{"name": "raises", "arguments": {"text": "x"}}</tool_call>',
            "42",
        ],
    )
    assert first == ["What is 6*7?"]
    malformed, ok, ok_again, failed, answer = steps
    assert malformed.observation.startswith("error:") and malformed.reward == -0.1 and not malformed.done
    assert ok.observation == "42" and ok.reward == pytest.approx(0.1) and ok.info.tool_status == "ok"
    assert ok_again.reward == 0.0  # process reward is paid once per episode: more calls never pay more
    assert failed.observation == "tool unavailable" and failed.reward == -0.5  # and the episode continues
    assert answer.done and answer.reward == 1.0 and answer.info.correct


def test_single_turn_env_is_the_one_step_case():
    env = ENVS.get("single_turn")(None, build_rewards([{"name": "math"}]))
    _, [step] = run_episode(env, Example("2+2=", "4", "4", {"answer": "4"}), ["4"])
    assert step.done and step.reward == 1.0 and step.info.correct and step.observation == ""


def test_tool_specs_build_registered_tools_with_options():
    service = EnvironmentService.from_specs([{"name": "calculator"}, {"name": "python", "options": {"timeout": 2}}])
    assert set(service.tools) == {"calculator", "python"}
    with pytest.raises(ValueError, match="a tool spec is"):
        EnvironmentService.from_specs([{"tool": "calculator"}])
    assert json.loads(json.dumps(service.tools["calculator"].schema()))["function"]["name"] == "calculator"


def test_a_tool_spec_can_give_the_tool_a_latency_model():
    service = EnvironmentService.from_specs([{"name": "calculator", "latency": {"kind": "fixed", "seconds": 0.2}}])
    start = time.perf_counter()
    result = asyncio.run(service.call("calculator", {"expression": "2+3"}))
    assert result.observation == "5" and time.perf_counter() - start >= 0.2
    with pytest.raises(ValueError, match="latency takes kind, seconds"):
        EnvironmentService.from_specs([{"name": "calculator", "latency": {"median": 1}}])


def test_gymnasium_environments_speak_the_same_protocol():
    env = ENVS.get("gym")(None, env_id="CartPole-v1", max_episode_steps=3)
    first, steps = run_episode(env, Example("", "", "", {"seed": 0}), ["push 1", "0", "action 1", "1"])
    assert first[0].startswith("observation: ") and first[0].endswith("action (0-1)?")
    assert [s.reward for s in steps] == [1.0, 1.0, 1.0] and steps[-1].done and steps[-1].info.correct
    _, [invalid] = run_episode(env, Example("", "", "", {"seed": 0}), ["left"])
    assert invalid.done and invalid.reward == -1.0 and invalid.info.extras["invalid_action"]
    for action in ("9" * 5000, "-" + "1" * 5000):  # past int()'s digit limit: invalid, not an error
        _, [invalid] = run_episode(env, Example("", "", "", {"seed": 0}), [action])
        assert invalid.info.extras["invalid_action"], action
    with pytest.raises(ValueError, match="Discrete"):
        ENVS.get("gym")(None, env_id="Pendulum-v1")
