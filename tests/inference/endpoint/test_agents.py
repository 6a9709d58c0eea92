"""External agents as environments: episodes, failure accounting, and the learner's tokens."""

import asyncio
from pathlib import Path

import pytest
import torch

from tests.helpers.endpoint import make_loop
from tests.inference.endpoint import agents_for_tests as agents
from unipg.config import ConfigError, load_config
from unipg.estimate import ADVANTAGES
from unipg.learn.lm import LMBatch, lm_advantages
from unipg.runtime.lm import group_index
from unipg.runtime.replay import Group
from unipg.sample.endpoint_agents import AgentStats, ExternalAgent, load_agent
from unipg.tasks.base import Example
from unipg.tasks.rewards.rules import build_rewards

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = Example("What is 2*3?", "6", "6", {"answer": "6"})
REWARDS = build_rewards([{"name": "math"}])


def play(loop, runs, examples=None):
    examples = examples or [EXAMPLE] * len(runs)
    return asyncio.run(loop.run_episodes([ExternalAgent(run, REWARDS) for run in runs], examples))


def test_the_learner_trains_exactly_the_tokens_and_log_probs_the_engine_sampled(policy):
    loop = make_loop(policy)
    [trajectory] = play(loop, [agents.two_turns])
    [(first_context, first), (second_context, second)] = loop.engine.sampled
    assert second_context[: len(first_context) + len(first.token_ids)] == first_context + first.token_ids
    batch = LMBatch.from_trajectories([trajectory], policy.pad_id)
    row = batch.input_ids[0, -batch.completion_length :][batch.completion_mask[0] == 1].tolist()
    assert row == first.token_ids + second.token_ids
    sampled_logprobs = batch.behaviour_logprobs[0][batch.completion_mask[0] == 1].tolist()
    assert sampled_logprobs == pytest.approx(first.behaviour_logprobs + second.behaviour_logprobs, abs=0)
    prompt = batch.input_ids[0, batch.attention_mask[0].argmax() :].tolist()
    assert prompt == second_context + second.token_ids  # every token the model saw, in order
    assert trajectory.turns == 2 and trajectory.infos[-1].final and trajectory.finish == "done"


def test_an_agent_that_rewrites_history_trains_both_trajectories_on_one_advantage(policy):
    loop = make_loop(policy)
    rewriting, other = play(loop, [agents.rewrites_history, agents.rewards_itself])
    assert loop.stats.extra_trajectories == 1 and len(rewriting.side) == 1 and not other.side
    rows = [rewriting, rewriting.side[0], other]
    batch = LMBatch.from_trajectories(
        [rewriting, other], policy.pad_id, groups=group_index([Group([rewriting, other], 0, 2)])
    )
    assert len(batch.scores) == 3 and batch.episodes.tolist() == [0, 0, 1] and batch.scores.tolist() == [1, 1, 0.25]
    sampled = [(context, output.token_ids, output.behaviour_logprobs) for context, output in loop.engine.sampled]
    for row, trajectory in enumerate(rows):  # each turn of each row: ids and log-probs the engine sampled there
        first = int(batch.attention_mask[row].argmax())
        prompt_width = batch.input_ids.shape[1] - batch.completion_length
        ids = batch.input_ids[row, first:][batch.attention_mask[row, first:] == 1].tolist()
        completion_start = prompt_width - first
        for turn in range(trajectory.turns):
            where = (batch.token_turns[row] == turn).nonzero().flatten()
            context = ids[: completion_start + int(where[0])]
            assert (
                context,
                ids[completion_start + int(where[0]) : completion_start + int(where[-1]) + 1],
                batch.behaviour_logprobs[row, where].tolist(),
            ) in sampled
    assert sum(len(t.turn_texts) for t in rows) == len(sampled) == 4  # every call is in a row
    assert rewriting.turns == 2 and rewriting.side[0].turns == 1  # the summary and its follow-up; the first call
    assert policy.tokenizer.decode(rewriting.prompt_ids).count("Earlier you said")
    config = load_config(None, ["algorithm=grpo", "task.name=calculator", "estimator.normalize_advantages=false"])
    advantages, _ = lm_advantages(batch, config.estimator, group_size=2, kl_coef=0.0)
    per_row = [float(advantages[row][batch.completion_mask[row] == 1][0]) for row in range(3)]
    expected = ADVANTAGES.call("grpo", {"scores": torch.tensor([1.0, 0.25]), "group_size": 2}, config.estimator)
    assert per_row == [float(expected[0]), float(expected[0]), float(expected[1])]


def test_failed_agents_are_counted_episodes_never_a_crashed_run(policy):
    loop = make_loop(policy, agent_retries=1)
    good, own, failed_raise, failed_garbage = play(
        loop, [agents.two_turns, agents.rewards_itself, agents.raises, agents.garbage]
    )
    assert good.finish == own.finish == "done" and own.reward == 0.25
    for failed, why in ((failed_raise, "agent bug"), (failed_garbage, "list")):
        assert failed.finish == "failed" and sum(failed.loss_mask) == 0 and why in failed.infos[-1].agent_error
    assert loop.stats.failures == 2 and loop.stats.retries == 2 and loop.stats.timeouts == 0
    assert len(loop.sessions) == 0  # every session closed
    LMBatch.from_trajectories([good, own, failed_raise], policy.pad_id)  # failed episodes still batch


def test_an_agent_that_hangs_costs_its_episode_the_timeout(policy):
    loop = make_loop(policy, agent_timeout=0.2, agent_retries=0)
    [hung] = play(loop, [agents.hangs])
    assert hung.finish == "failed" and "ran past" in hung.infos[-1].agent_error
    assert loop.stats.failures == 1 and loop.stats.timeouts == 1


def test_an_openai_agents_sdk_agent_with_a_function_tool_plays_episodes_concurrently(policy):
    loop = make_loop(policy)
    trajectories = play(loop, [agents.sdk_agent] * 2 + [agents.sdk_streamed_agent] * 2)
    assert [t.finish for t in trajectories] == ["done"] * 4 and loop.stats.failures == 0
    assert all(sum(t.loss_mask) > 0 for t in trajectories)
    assert "Use the calculator." in policy.tokenizer.decode(trajectories[0].prompt_ids)


def test_agent_specs_name_a_module_or_a_file_and_bad_ones_are_config_errors(tmp_path):
    assert load_agent("tests.inference.endpoint.agents_for_tests:two_turns") is agents.two_turns
    path = tmp_path / "mine.py"
    path.write_text("async def run(base_url, api_key, example):\n    return 1.0\n")
    assert load_agent(f"{path}:run").__name__ == "run"
    for spec, message in (
        ("nocolon", "package.module"),
        (f"{tmp_path}/missing.py:run", "no file"),
        ("tests.inference.endpoint.agents_for_tests:nothing", "no async function"),
        ("no_such_package_here:run", "cannot import"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_agent(spec)


def test_a_file_agent_is_stored_absolute_and_is_the_same_module_as_the_plugin_of_that_file(tmp_path, monkeypatch):
    from unipg.config.plugins import import_plugin

    (tmp_path / "mine.py").write_text("async def run(base_url, api_key, example):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    config = load_config(None, ["task.name=calculator", "task.agent=./mine.py:run"])
    assert config.task.agent == f"{tmp_path / 'mine.py'}:run"  # what a Ray worker or a resumed run loads
    assert load_agent(config.task.agent) is import_plugin(str(tmp_path / "mine.py")).run


def test_an_external_agent_on_ray_needs_free_ports_and_a_worker_timeout_past_its_own():
    base = ["task.name=calculator", "task.agent=tests.inference.endpoint.agents_for_tests:two_turns", "backend=ray"]
    assert load_config(None, base).backend == "ray"  # each rollout worker serves its own endpoint
    with pytest.raises(ConfigError, match=r"endpoint.port \(8000\) is fixed, but with backend=ray"):
        load_config(None, [*base, "endpoint.port=8000"])
    with pytest.raises(ConfigError, match=r"ray.episode_timeout \(100 s\) is shorter .* = 600 s"):
        load_config(None, [*base, "ray.episode_timeout=100"])


def test_agent_counts_are_zeroed_where_the_loop_counts_them_and_add_up_over_workers():
    counting = AgentStats(episodes=4, failures=1, retries=2, extra_trajectories=3)
    popped = counting.pop()
    assert popped == AgentStats(episodes=4, failures=1, retries=2, extra_trajectories=3) and counting == AgentStats()
    counting.extra_trajectories += 1  # a loop holding ``counting`` goes on counting into it
    popped.merge(counting.pop())
    assert popped.metrics("rollout") == {
        "rollout/agent_failures": 1,
        "rollout/agent_timeouts": 0,
        "rollout/agent_retries": 2,
        "rollout/agent_extra_trajectories": 4,
    }


def test_the_endpoint_benchmarks_openai_agent_gets_the_calculators_result(policy, monkeypatch):
    """The benchmark's agent calls the registered calculator as the environment does: the tool message the model
    reads next holds the result, not an error."""
    from unipg.inference import TurnOutput

    agent = load_agent(f"{ROOT / 'benchmarks' / 'endpoint.py'}:openai_agent")
    loop = make_loop(policy)
    replies = iter(['<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>', "6"])
    contexts = []

    async def scripted(context_ids, **options):
        text = next(replies)
        contexts.append(context_ids)
        tokens = policy.tokenizer(text, add_special_tokens=False)["input_ids"]
        return TurnOutput(tokens, [-0.5] * len(tokens), text, "stop", False, 0)

    monkeypatch.setattr(loop.engine, "generate", scripted)
    [trajectory] = play(loop, [agent])
    observation = policy.tokenizer.decode(contexts[1][len(contexts[0]) :])
    assert observation.endswith("<|tool|>6<|end|><|assistant|>") and "error" not in observation
    assert trajectory.turn_texts == [*trajectory.turn_texts[:1], "6"] and trajectory.correct
