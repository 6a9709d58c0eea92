"""The classic driver on the rollout/learner runtime: η = 0 is synchronous training, η > 0 bounded staleness."""

import pytest
import torch

from unipg.config import load_config
from unipg.learn.gym import GradientLearner, prepare_segment
from unipg.observe.metrics import read_metrics
from unipg.policy.mlp import MLPActorCritic
from unipg.runtime.gym import train_gym
from unipg.sample.gym_rollout import GymRollout


def short_config(tmp_path, name, *overrides):
    return load_config(
        None,
        [
            f"log.output_dir={tmp_path}",
            "log.progress=false",
            "log.tensorboard=false",
            f"log.run_name={name}",
            "eval.episodes=3",
            "eval.every_steps=512",
            "log.log_every_updates=1",
            "algorithm=ppo",
            "train.batch_transitions=256",
            "train.mini_batch_transitions=64",
            "train.num_epochs=2",
            *overrides,
        ],
    )


def train_records(result) -> list[dict]:
    return [record for record in read_metrics(result.run_dir) if "train/update" in record]


def without_clock(record: dict) -> dict:
    return {
        key: value for key, value in record.items() if key != "time" and not key.startswith(("timing/", "async/buffer"))
    }


@pytest.mark.e2e
def test_sequential_and_concurrent_schedules_coincide_at_eta_0(tmp_path):
    results = [
        train_gym(
            short_config(
                tmp_path, schedule, "env.total_steps=1536", f"runtime.schedule={schedule}", "eval.deterministic=false"
            )
        )  # evaluation draws random numbers too
        for schedule in ("sequential", "concurrent")
    ]
    assert results[0].eval_history == results[1].eval_history
    first, second = (train_records(result) for result in results)
    assert [without_clock(r) for r in first] == [without_clock(r) for r in second]
    assert all(r["async/staleness_step_max"] == 0 for r in first + second)


@pytest.mark.e2e
def test_sequential_eta_2_trains_every_step_on_data_exactly_two_versions_old(tmp_path):
    config = short_config(
        tmp_path, "stale", "env.total_steps=2048", "runtime.schedule=sequential", "runtime.max_staleness=2"
    )
    records = train_records(train_gym(config))
    assert len(records) == 8
    assert [r["async/staleness_trajectory_max"] for r in records] == [0, 1, 2, 2, 2, 2, 2, 2]  # warm-up: 0, 1
    assert all(r["async/staleness_step_mean"] == r["async/staleness_step_max"] == 2 for r in records[2:])
    assert all(r["async/staleness_step_frac_2"] == 1.0 for r in records[2:])


@pytest.mark.e2e
def test_concurrent_eta_1_runs_and_never_trains_on_older_data(tmp_path):
    config = short_config(
        tmp_path, "concurrent", "env.total_steps=2048", "runtime.schedule=concurrent", "runtime.max_staleness=1"
    )
    result = train_gym(config)
    records = train_records(result)
    assert len(records) == 8 and result.env_steps == 2048
    assert max(r["async/staleness_step_max"] for r in records) <= 1
    assert max(r["async/staleness_trajectory_max"] for r in records) <= 1


def learner_and_segment(*overrides):
    config = load_config(
        None,
        [
            "algorithm=ppo",
            "env.num_envs=2",
            "train.batch_transitions=32",
            "train.mini_batch_transitions=16",
            *overrides,
        ],
    )
    rollout = GymRollout("CartPole-v1", 2, seed=0, gamma=config.estimator.gamma)
    torch.manual_seed(0)
    policy = MLPActorCritic(rollout.observation_space, rollout.action_space, hidden_sizes=(16,))
    batch = rollout.collect(policy, 16, bootstrap=True)
    rollout.close()
    with torch.no_grad():  # the learner has moved on since the segment was collected
        for parameter in policy.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return config, policy, batch


def test_decoupled_ppo_anchors_at_the_current_policy_only_when_the_data_is_stale():
    config, policy, batch = learner_and_segment("estimator.policy_loss=decoupled_ppo")
    learner = GradientLearner(policy, config)
    stale = prepare_segment(policy, batch, config.estimator, age=2).samples
    with torch.no_grad():
        current, _, _ = policy.evaluate(stale["observations"], stale["actions"])
    proximal = learner.proximal_logprobs(stale)
    assert torch.equal(proximal, current) and not torch.allclose(proximal, stale["behaviour_logprobs"])
    fresh = prepare_segment(policy, batch, config.estimator, age=0).samples
    assert torch.equal(learner.proximal_logprobs(fresh), fresh["behaviour_logprobs"])
    ppo = GradientLearner(policy, load_config(None, ["algorithm=ppo"]))
    assert torch.equal(ppo.proximal_logprobs(stale), stale["behaviour_logprobs"])  # plain PPO clips against μ
    assert "behaviour_weight_mean" in learner.update(stale)


def test_a_stale_segment_gets_the_current_critics_values_before_gae():
    config, policy, batch = learner_and_segment()
    fresh = prepare_segment(policy, batch, config.estimator, age=0)
    assert torch.equal(fresh.batch.values, batch.values) and torch.equal(fresh.samples["age"], torch.zeros(32))
    stale = prepare_segment(policy, batch, config.estimator, age=3)
    with torch.no_grad():
        assert torch.allclose(stale.batch.values, policy.value(batch.observations.reshape(32, -1)).reshape(2, 16))
        assert torch.allclose(stale.batch.bootstrap_value, policy.value(batch.final_observations))
    assert not torch.allclose(stale.batch.values, batch.values)
    assert not torch.allclose(stale.advantages, fresh.advantages)
    assert torch.equal(stale.samples["age"], torch.full((32,), 3.0))


def test_with_values_re_evaluates_the_time_limit_bootstrap_in_the_rewards():
    from unipg.sample.gym_rollout import RolloutBatch

    observations = torch.arange(12, dtype=torch.float32).reshape(1, 3, 4)  # (N=1, T=3, obs_dim=4)
    truncated = torch.tensor([[0.0, 1.0, 0.0]])
    cut_observations = torch.zeros(1, 3, 4)
    cut_observations[0, 1] = 1.0
    batch = RolloutBatch(
        observations,
        torch.zeros(1, 3),
        torch.zeros(1, 3),
        torch.zeros(1, 3),
        rewards=torch.tensor([[1.0, 1.0 + 0.5 * 7.0, 1.0]]),
        dones=truncated,
        mask=torch.ones(1, 3),
        bootstrap_value=torch.zeros(1),
        final_observations=torch.ones(1, 4),
        truncated=truncated,
        truncation_observations=cut_observations,
        truncation_values=7.0 * truncated,
    )
    refreshed = batch.with_values(lambda x: x.sum(-1), gamma=0.5)  # V(s) = Σ s: 4 at the cut state
    assert torch.equal(refreshed.rewards, torch.tensor([[1.0, 1.0 + 0.5 * 4.0, 1.0]]))
    assert torch.equal(refreshed.values, observations.sum(-1)) and torch.equal(
        refreshed.bootstrap_value, torch.tensor([4.0])
    )
    assert torch.equal(batch.rewards, torch.tensor([[1.0, 4.5, 1.0]]))  # the segment itself is untouched
