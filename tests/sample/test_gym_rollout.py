import pytest
import torch

from unipg.policy.mlp import MLPActorCritic
from unipg.sample.gym_rollout import (
    GymRollout,
    RewardScaler,
    complete_episode_mask,
    evaluate_policy,
    make_env,
)


def make_policy(rollout):
    return MLPActorCritic(rollout.observation_space, rollout.action_space, hidden_sizes=[8])


def test_rollout_shapes_and_episode_accounting():
    rollout = GymRollout("CartPole-v1", 3, seed=0, gamma=0.99, max_episode_steps=10)
    batch = rollout.collect(make_policy(rollout), 25, bootstrap=True)
    assert batch.observations.shape == (3, 25, 4)
    for name in ("actions", "behaviour_logprobs", "values", "rewards", "dones", "mask"):
        assert getattr(batch, name).shape == (3, 25)
    assert batch.bootstrap_value.shape == (3,)
    assert len(batch.episode_returns) == int(batch.dones.sum()) >= 6  # episodes last at most 10 steps
    assert all(length <= 10 for length in batch.episode_lengths)
    rollout.close()


def test_time_limit_truncation_is_bootstrapped_with_the_critic():
    rollout = GymRollout("CartPole-v1", 1, seed=0, gamma=0.5, max_episode_steps=3)
    policy = make_policy(rollout)
    with torch.no_grad():
        policy.critic[-1].bias.fill_(10.0)  # V ≈ 10 everywhere
    batch = rollout.collect(policy, 3, bootstrap=True)
    # CartPole cannot fail within 3 steps from its start, so the episode is truncated at step 3:
    assert batch.dones[0].tolist() == [0.0, 0.0, 1.0]
    assert batch.rewards[0, 2].item() == pytest.approx(1.0 + 0.5 * 10.0, abs=0.5)
    assert batch.rewards[0, :2].tolist() == [1.0, 1.0]


def test_monte_carlo_rollouts_mask_unfinished_episodes():
    rollout = GymRollout("CartPole-v1", 2, seed=0, gamma=0.99, max_episode_steps=4)
    batch = rollout.collect(make_policy(rollout), 10, bootstrap=False)
    # episodes end at steps 3 and 7 (0-based); steps 8 and 9 belong to an unfinished episode
    assert batch.mask[:, :8].eq(1).all() and batch.mask[:, 8:].eq(0).all()
    assert batch.bootstrap_value.eq(0).all()


def test_complete_episode_mask_hand_example():
    dones = torch.tensor([[0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1]], dtype=torch.float32)
    expected = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    assert torch.equal(complete_episode_mask(dones), expected)


def test_evaluate_policy_runs_the_requested_number_of_episodes():
    rollout = GymRollout("CartPole-v1", 1, seed=0, gamma=0.99)
    returns = evaluate_policy(make_policy(rollout), "CartPole-v1", episodes=4, seed=1, max_episode_steps=20)
    assert len(returns) == 4 and all(1 <= r <= 20 for r in returns)


def test_reward_scaler_tracks_return_scale():
    import numpy as np

    scaler = RewardScaler(num_envs=2, gamma=0.9)
    for _ in range(200):
        scaled = scaler(np.array([10.0, 10.0]), np.array([False, False]))
    # the discounted return converges to 100 with zero variance at the end; scaled rewards stay finite
    assert np.all(np.isfinite(scaled))
    state = scaler.state_dict()
    other = RewardScaler(num_envs=2, gamma=0.9)
    other.load_state_dict(state)
    assert other(np.array([1.0, 1.0]), np.array([True, True])) == pytest.approx(
        scaler(np.array([1.0, 1.0]), np.array([True, True]))
    )


def test_unknown_environment_suggests_a_registered_id():
    with pytest.raises(ValueError, match="CartPole-v1"):
        make_env("CartPole-v9")
