import gymnasium as gym
import pytest
import torch

from unipg.config import load_config
from unipg.learn import mlp_gradient
from unipg.learn.common import shuffled_minibatches
from unipg.learn.gym import GradientLearner, epoch_minibatches, normalized, uses_critic
from unipg.learn.objective import ObjectiveBatch, unified_objective
from unipg.policy.mlp import MLPActorCritic


def _policy(activation: str = "tanh", continuous: bool = False) -> MLPActorCritic:
    torch.manual_seed(0)
    actions = gym.spaces.Box(-1, 1, (2,)) if continuous else gym.spaces.Discrete(3)
    return MLPActorCritic(gym.spaces.Box(-1, 1, (4,)), actions, hidden_sizes=[16, 8], activation=activation)


def _objective(policy, estimator, observations, actions, behaviour, advantages, returns, hand: bool):
    if hand:
        logprobs, entropy, values, saved = mlp_gradient.evaluate(policy, observations, actions)
    else:
        logprobs, entropy, values = policy.evaluate(observations, actions, entropy_grad=False)
    critic = uses_critic(estimator)
    batch = ObjectiveBatch.from_steps(
        logprobs=logprobs,
        behaviour_logprobs=behaviour,
        proximal_logprobs=None,
        advantages=normalized(advantages, estimator),
        age=None,
        entropy=entropy,
        values=values if critic else None,
        old_values=None,
        returns=returns if critic else None,
    )
    out = unified_objective(batch, estimator, tensor_metrics=True)
    if hand:
        assert mlp_gradient.objective_by_hand(estimator, batch) == (
            estimator.policy_loss == "ppo" and not estimator.dual_clip
        )
        mlp_gradient.backward(policy, saved, out.loss, batch, estimator)
    else:
        for parameter in policy.parameters():
            parameter.grad = None
        out.loss.backward()
    # autograd leaves the gradient of a network the loss does not read at None: zero
    return out, [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in policy.parameters()]


@pytest.mark.parametrize("activation", ["tanh", "relu"])
@pytest.mark.parametrize(
    "overrides",
    [
        [],  # PPO's gradient from the clip rule (mlp_gradient.objective_gradient)
        ["estimator.clip_range_high=0.3", "estimator.value_loss_coef=2.0"],
        ["estimator.dual_clip=3.0"],  # the objective's gradient by autograd
        ["estimator.advantage=reward_to_go", "estimator.policy_loss=vanilla"],
    ],
)
def test_hand_written_gradient_is_autograds(activation, overrides):
    estimator = load_config(None, overrides).estimator
    policy = _policy(activation)
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):  # random batches: ratios inside and outside the clip range, advantages of both signs
        observations = torch.randn(64, 4, generator=generator)
        actions = torch.randint(0, 3, (64,), generator=generator)
        with torch.no_grad():
            current, _, _ = policy.evaluate(observations, actions)
        behaviour = current + 0.4 * torch.randn(64, generator=generator)
        advantages = torch.randn(64, generator=generator)
        returns = torch.randn(64, generator=generator)
        args = (policy, estimator, observations, actions, behaviour, advantages, returns)
        expected, expected_grads = _objective(*args, hand=False)
        out, grads = _objective(*args, hand=True)
        torch.testing.assert_close(out.loss, expected.loss)
        for key, value in expected.metrics.items():
            torch.testing.assert_close(out.metrics[key], value)
        for grad, expected_grad in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-6)
        if "clip_fraction" in expected.metrics:  # both the clipped and the unclipped branch were exercised
            assert 0 < float(expected.metrics["clip_fraction"]) < 1


def test_learner_takes_the_hand_written_path_only_where_it_applies():
    config = load_config(None, [])
    assert GradientLearner(_policy(), config).hand_gradient
    assert not GradientLearner(_policy(continuous=True), config).hand_gradient
    entropy_config = load_config(None, ["estimator.entropy_coef=0.01"])
    assert not GradientLearner(_policy(), entropy_config).hand_gradient


def test_an_update_on_the_hand_written_path_takes_autograds_steps():
    config = load_config(None, ["train.mini_batch_transitions=16", "train.num_epochs=2"])
    hand, reference = GradientLearner(_policy(), config), GradientLearner(_policy(), config)
    reference.hand_gradient = False
    generator = torch.Generator().manual_seed(2)
    samples = {
        "observations": torch.randn(64, 4, generator=generator),
        "actions": torch.randint(0, 3, (64,), generator=generator),
        "behaviour_logprobs": torch.full((64,), -1.1) + 0.3 * torch.randn(64, generator=generator),
        "values": torch.randn(64, generator=generator),
        "mask": torch.ones(64),
        "advantages": torch.randn(64, generator=generator),
        "returns": torch.randn(64, generator=generator),
        "age": torch.zeros(64),
    }
    metrics, expected = hand.update(samples), reference.update(samples)
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6)
    for name, value in reference.policy.state_dict().items():
        torch.testing.assert_close(hand.policy.state_dict()[name], value, rtol=1e-4, atol=1e-6)


def test_epoch_minibatches_are_the_shuffled_minibatches_gathered_per_epoch():
    samples = {"x": torch.arange(40.0).reshape(20, 2), "y": torch.arange(20)}
    valid = torch.arange(0, 20, 2)  # masked samples are never drawn; the last mini-batch may be smaller
    got = list(epoch_minibatches(samples, valid, 4, 3, torch.Generator().manual_seed(5)))
    expected = [
        {key: value.index_select(0, index) for key, value in samples.items()}
        for index in shuffled_minibatches(valid, 4, epochs=3, generator=torch.Generator().manual_seed(5))
    ]
    assert len(got) == len(expected) == 9
    for mini, reference in zip(got, expected, strict=True):
        for key in samples:
            assert torch.equal(mini[key], reference[key])
    assert list(epoch_minibatches(samples, valid[:0], 4, 3, torch.Generator())) == []
