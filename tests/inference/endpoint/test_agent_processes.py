"""External agents played in worker processes (``endpoint.agent_processes``): what they sample is recorded token
for token as on the agents' thread, what they raise or return fails or scores the attempt alike, the timeout fires
and cancels the attempt in its worker, and a worker that dies is replaced, its attempts started again."""

import asyncio

import pytest
import torch

from tests.helpers.endpoint import make_loop
from unipg.sample.agent_processes import ProcessAgent
from unipg.sample.endpoint_agents import ExternalAgent
from unipg.tasks.base import Example
from unipg.tasks.rewards.rules import build_rewards

SPEC = "tests.inference.endpoint.agents_in_processes:acts"
REWARDS = build_rewards([{"name": "math"}])


@pytest.fixture(scope="module")
def in_worker():
    """The test agent in one worker process, started once for the module."""
    agent = ProcessAgent(SPEC, 1)
    yield agent
    agent.close()


def example(act: str, **columns) -> Example:
    return Example("What is 2*3?", "6", "6", {"answer": "6", "act": act, **columns})


def play(loop, agent, *examples):
    async def main():
        async with loop.running():
            return await asyncio.gather(
                *(loop.run_episode(ExternalAgent(agent, REWARDS), each, order) for order, each in enumerate(examples))
            )

    return asyncio.run(main())


def test_every_token_sampled_for_an_agent_in_a_worker_is_in_its_episode_with_its_log_prob(policy, in_worker):
    loop = make_loop(policy)
    (episode,) = play(loop, in_worker, example("log_probs"))
    trajectories = [episode, *episode.side]
    sampled = [output for _, output in loop.engine.sampled]
    trained = [token for each in trajectories for token, mask in zip(each.token_ids, each.loss_mask) if mask]
    assert episode.finish == "done" and len(trained) == sum(len(output.token_ids) for output in sampled)
    # the agent rewards itself the sum of the log-probs the endpoint sent it, in its own process
    logprobs = sum(logprob for output in sampled for logprob in output.behaviour_logprobs)
    assert episode.step_rewards[-1] == pytest.approx(logprobs)
    recorded = sum(lp for each in trajectories for lp, mask in zip(each.behaviour_logprobs, each.loss_mask) if mask)
    assert recorded == pytest.approx(logprobs)


def test_what_an_agent_raises_or_returns_unpicklable_in_its_worker_fails_the_attempt(policy, in_worker):
    loop = make_loop(policy, agent_retries=0)
    raised, unpicklable = play(loop, in_worker, example("raises"), example("unpicklable"))
    assert raised.finish == unpicklable.finish == "failed" and loop.stats.failures == 2
    assert raised.infos[0].agent_error == "the agent raised RuntimeError: agent bug"
    assert "cannot be sent between processes" in unpicklable.infos[0].agent_error


def test_the_timeout_fires_for_an_agent_in_a_worker_and_cancels_it_there(policy, in_worker):
    loop = make_loop(policy, agent_timeout=1.0, agent_retries=0)
    (hung,) = play(loop, in_worker, example("hangs"))
    assert hung.finish == "failed" and loop.stats.timeouts == 1
    assert hung.infos[0].agent_error == "the agent ran past 1 s"
    # the worker answered the cancellation before the next attempt's result (one pipe, in order)
    (after,) = play(make_loop(policy), in_worker, example("two_turns"))
    assert after.finish == "done" and all(not worker.pending for worker in in_worker.workers)


def test_a_worker_that_dies_is_replaced_and_its_attempt_starts_again_without_a_retry(policy, tmp_path):
    agent = ProcessAgent(SPEC, 1)
    first = agent.workers[0]
    try:
        loop = make_loop(policy, agent_retries=0)
        (episode,) = play(loop, agent, example("dies_once", marker=str(tmp_path / "died")))
        assert episode.finish == "done" and loop.stats.retries == loop.stats.failures == 0
        assert agent.workers[0] is not first and first.process.exitcode == 3
    finally:
        agent.close()
    assert not agent.workers[0].process.is_alive()


def test_a_runner_with_agent_processes_plays_its_episodes_in_workers_and_ends_them_when_closed(policy):
    from unipg.config import load_config
    from unipg.sample.episodes import EpisodeRunner
    from unipg.tasks.base import make_task

    config = load_config(
        None,
        [
            "task.name=calculator",
            "task.options={digits: 1, num_train: 4, num_test: 2}",
            f"task.agent={SPEC}",
            "endpoint.agent_processes=1",
            "sample.max_new_tokens=8",
        ],
    )
    task = make_task(config.task.name, **config.task.options)
    runner = EpisodeRunner(policy, task, config, REWARDS)
    try:
        assert isinstance(runner.agent_threads.agent, ProcessAgent)
        trajectories = runner.run(task.test[:2], generator=torch.Generator().manual_seed(0)).trajectories
        assert [each.finish for each in trajectories] == ["done", "done"]
    finally:
        runner.close()
    assert not runner.agent_threads.agent.workers[0].process.is_alive()
