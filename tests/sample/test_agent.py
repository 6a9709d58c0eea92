import asyncio

import pytest
import torch

from unipg.envs.base import StepResult
from unipg.inference import HFService, SamplingParams
from unipg.learn.lm import LMBatch
from unipg.policy.chat import TurnTemplate
from unipg.policy.generation import cut_at_stop
from unipg.sample.agent import AgentLoop
from unipg.tasks.base import Example

OBSERVATION = "tool says 42"


class TwoTurnEnv:
    """Whatever the policy writes, the first turn gets an observation and the second ends the episode."""

    observation_role = "tool"

    def __init__(self, delay: float = 0.0):
        self.delay, self.turns = delay, 0

    async def reset(self, example):
        self.turns = 0
        return example.prompt

    async def step(self, action):
        self.turns += 1
        await asyncio.sleep(self.delay)
        if self.turns == 1:
            return StepResult(OBSERVATION, 0.1, False, {"tool_status": "ok"})
        return StepResult("", 1.0, True, {"final": True, "correct": True})


@pytest.fixture(scope="module")
def policy(tiny_policy):
    return tiny_policy()


def make_loop(policy, *, temperature=1.0, seed=0, batch_wait=None, max_total_tokens=200):
    engine = HFService(
        policy,
        SamplingParams(temperature=temperature),
        generator=torch.Generator().manual_seed(seed),
        batch_wait=batch_wait,
    )
    template = TurnTemplate(policy.tokenizer)
    encode = lambda text: policy.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    return AgentLoop(engine, template, encode, max_turns=3, max_new_tokens=12, max_total_tokens=max_total_tokens)


def run(loop, count=1, delay=0.0):
    examples = [Example(f"<|user|>question {i}<|end|><|assistant|>", "42", "") for i in range(count)]
    return asyncio.run(loop.run_episodes([TwoTurnEnv(delay) for _ in examples], examples))


def test_loss_mask_is_one_exactly_on_sampled_tokens_of_a_two_turn_episode(policy):
    loop = make_loop(policy)
    [trajectory] = run(loop)
    assert trajectory.turns == 2 and trajectory.finish == "done" and trajectory.step_rewards == [0.1, 1.0]
    tokens, mask = trajectory.token_ids, trajectory.loss_mask
    first = trajectory.turn_of_token.count(0)
    second = trajectory.turn_of_token.count(1)
    inserted = tokens[first : len(tokens) - second]
    # the environment inserted the closing of the turn, the observation message and the next assistant opening
    expected = loop.template.closing(tokens[first - 1] in policy.eos_ids) + loop.template.observation(OBSERVATION)
    assert policy.tokenizer.decode(inserted) == expected
    assert mask == [1] * first + [0] * len(inserted) + [1] * second
    assert all(lp == 0.0 for lp, m in zip(trajectory.behaviour_logprobs, mask) if m == 0)
    assert all(lp < 0.0 for lp, m in zip(trajectory.behaviour_logprobs, mask) if m == 1)


def test_training_forward_reproduces_the_behaviour_logprobs_of_every_turn(policy):
    trajectories = run(make_loop(policy, seed=3), count=4)
    batch = LMBatch.from_trajectories(trajectories, policy.pad_id)
    with torch.no_grad():
        logprobs = policy.evaluate(batch.input_ids, batch.attention_mask, batch.completion_length).logprobs
    sampled = batch.completion_mask.bool()
    assert torch.allclose(logprobs[sampled], batch.behaviour_logprobs[sampled], atol=1e-4)
    assert torch.equal(batch.turn_rewards, torch.tensor([[0.1, 1.0]] * 4))
    assert set(batch.token_turns[~sampled].tolist()) <= {-1}


def test_concurrent_episodes_share_generate_calls(policy):
    loop = make_loop(policy, batch_wait=None)
    trajectories = run(loop, count=6, delay=0.05)
    assert len(trajectories) == 6 and all(t.turns == 2 for t in trajectories)
    assert loop.engine.batches == [6, 6]  # two turns, each one batched call for all six episodes


def test_seeded_rollouts_are_reproducible(policy):
    first = run(make_loop(policy, seed=5), count=3)
    second = run(make_loop(policy, seed=5), count=3)
    assert [t.token_ids for t in first] == [t.token_ids for t in second]


def test_an_episode_that_runs_out_of_tokens_ends_without_a_final_reward(policy):
    [trajectory] = run(make_loop(policy, max_total_tokens=14))
    assert trajectory.finish == "max_tokens" and trajectory.step_rewards == [0.1]
    assert len(trajectory.token_ids) <= 14


def test_cut_at_stop_cuts_at_the_earliest_stop_string_and_keeps_it_when_asked():
    assert cut_at_stop("a</call>b\n\nc", ["\n\n", "</call>"]) == "a"
    assert cut_at_stop("a</call>b\n\nc", ["\n\n", "</call>"], keep=("</call>",)) == "a</call>"
    assert cut_at_stop("abc", ["x"]) == "abc" and cut_at_stop("abc", None) == "abc"


def test_a_kept_stop_string_reaches_the_environment(policy):
    """A tool call stopped at its closing tag must still hold the tag, or the parser sees an unclosed call."""
    prompt = policy.tokenizer("<|user|>question<|end|><|assistant|>", add_special_tokens=False)["input_ids"]

    def turn(params):
        engine = HFService(policy, params, generator=torch.Generator().manual_seed(3), batch_wait=None)

        async def one_turn():
            async with engine.running(), engine.episode():
                return await engine.generate(prompt, max_new_tokens=24)

        return asyncio.run(one_turn())

    free = turn(SamplingParams())  # same seed, so the same tokens up to wherever a stop string ends the turn
    stop = free.text[3]
    cut = turn(SamplingParams(stop=[stop]))
    kept = turn(SamplingParams(stop=[stop], keep_stop=(stop,)))
    assert cut.text == free.text[: free.text.index(stop)]
    assert kept.text == cut.text + stop and kept.finish_reason == "stop"


def test_a_turn_a_weight_load_interrupted_gives_each_token_the_age_of_the_version_that_sampled_it():
    from unipg.inference.base import TurnOutput
    from unipg.sample.agent import Trajectory

    trajectory = Trajectory(Example("1+1", "2", "2"), [5, 6])
    trajectory.add_turn(TurnOutput([7, 8, 9], [-1.0] * 3, "a", "stop", False, 2))
    trajectory.add_inserted([10, 11])
    trajectory.add_turn(TurnOutput([12, 13, 14, 15], [-1.0] * 4, "b", "stop", True, 3, version_changes=((1, 5),)))
    assert trajectory.version_changes == [(6, 5)] and trajectory.policy_versions == [2, 3]
    batch = LMBatch.from_trajectories([trajectory], pad_id=0, version=6)
    assert batch.ages[0].tolist() == [4, 4, 4, 0, 0, 3, 1, 1, 1]  # inserted tokens have none
