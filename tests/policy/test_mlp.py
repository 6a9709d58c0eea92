import gymnasium as gym
import numpy as np
import pytest
import torch

from unipg.policy.mlp import MLPActorCritic


def test_categorical_policy_logprobs_match_between_acting_and_training():
    policy = MLPActorCritic(gym.spaces.Box(-1, 1, (4,)), gym.spaces.Discrete(3), hidden_sizes=[16])
    observations = torch.randn(10, 4)
    sample = policy.act(observations)
    logprobs, entropy, values = policy.evaluate(observations, sample.actions)
    assert sample.actions.shape == (10,) and sample.actions.dtype == torch.int64
    torch.testing.assert_close(logprobs, sample.logprobs)
    torch.testing.assert_close(values, sample.values)
    assert torch.all(entropy <= np.log(3) + 1e-6)


def test_deterministic_action_is_the_mode():
    policy = MLPActorCritic(gym.spaces.Box(-1, 1, (4,)), gym.spaces.Discrete(3), hidden_sizes=[16])
    observations = torch.randn(5, 4)
    greedy = policy.act(observations, deterministic=True).actions
    assert torch.equal(greedy, policy.distribution(observations).probs.argmax(-1))


def test_gaussian_policy_shapes_and_initial_std():
    policy = MLPActorCritic(
        gym.spaces.Box(-1, 1, (3,)), gym.spaces.Box(-2, 2, (2,)), hidden_sizes=[16], log_std_init=-0.5
    )
    sample = policy.act(torch.randn(6, 3))
    assert sample.actions.shape == (6, 2) and sample.logprobs.shape == (6,)
    torch.testing.assert_close(
        policy.distribution(torch.randn(1, 3)).stddev, torch.full((1, 2), np.exp(-0.5)), rtol=1e-5, atol=1e-6
    )
    assert any(p is policy.log_std for p in policy.actor_parameters())


def test_unsupported_spaces_are_rejected_with_advice():
    with pytest.raises(ValueError, match="FlattenObservation"):
        MLPActorCritic(gym.spaces.Box(-1, 1, (2, 2)), gym.spaces.Discrete(2), hidden_sizes=[8])
    with pytest.raises(ValueError, match="Discrete or flat Box"):
        MLPActorCritic(gym.spaces.Box(-1, 1, (2,)), gym.spaces.MultiDiscrete([2, 2]), hidden_sizes=[8])


def test_fast_discrete_evaluation_matches_the_distribution():
    policy = MLPActorCritic(gym.spaces.Box(-1, 1, (4,)), gym.spaces.Discrete(5), hidden_sizes=[16])
    observations, actions = torch.randn(7, 4), torch.randint(0, 5, (7,))
    logprobs, entropy, _ = policy.evaluate(observations, actions)
    dist = policy.distribution(observations)
    torch.testing.assert_close(logprobs, dist.log_prob(actions))
    torch.testing.assert_close(entropy, dist.entropy())


def test_acting_reads_actor_and_critic_as_one_network_and_follows_their_updates():
    policy = MLPActorCritic(gym.spaces.Box(-1, 1, (4,)), gym.spaces.Discrete(3), hidden_sizes=[16, 8])
    observations = torch.randn(6, 4)
    torch.testing.assert_close(policy.act(observations).values, policy.value(observations))
    with torch.no_grad():  # written in place, as an optimizer step or a weight load does
        for parameter in (*policy.actor_parameters(), *policy.critic_parameters()):
            parameter.add_(0.1 * torch.randn_like(parameter))
    sample = policy.act(observations)
    logprobs, _, values = policy.evaluate(observations, sample.actions)
    torch.testing.assert_close(sample.logprobs, logprobs)
    torch.testing.assert_close(sample.values, values)
    assert not sample.values.requires_grad and not sample.logprobs.requires_grad


def test_entropy_without_gradient_has_the_same_value():
    policy = MLPActorCritic(gym.spaces.Box(-1, 1, (4,)), gym.spaces.Discrete(3), hidden_sizes=[16])
    observations, actions = torch.randn(5, 4), torch.randint(0, 3, (5,))
    _, entropy, _ = policy.evaluate(observations, actions)
    _, detached, _ = policy.evaluate(observations, actions, entropy_grad=False)
    assert entropy.requires_grad and not detached.requires_grad
    torch.testing.assert_close(detached, entropy)
