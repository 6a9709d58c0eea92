"""The unified objective: its terms on a hand-computed example, and both learners going through it."""

import math

import pytest
import torch

from tests.helpers.batches import make_batch, make_config
from unipg.config import load_config
from unipg.config.schema import EstimatorConfig
from unipg.learn import objective
from unipg.learn.gym import GradientLearner, prepare_segment
from unipg.learn.lm import LMLearner
from unipg.learn.objective import ObjectiveBatch, micro_batch_share, unified_objective
from unipg.policy.mlp import MLPActorCritic
from unipg.sample.gym_rollout import GymRollout


def token_batch() -> ObjectiveBatch:
    """Two sequences, three valid tokens; ρ = π/μ = (1.25, 1.0, 2.0) on them."""
    logprobs = torch.log(torch.tensor([[0.5, 0.5], [0.5, 1.0]])).requires_grad_()
    return ObjectiveBatch(
        logprobs=logprobs,
        behaviour_logprobs=torch.log(torch.tensor([[0.4, 0.5], [0.25, 1.0]])),
        advantages=torch.tensor([[1.0, -1.0], [2.0, 0.0]]),
        mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
        entropy=torch.tensor([[1.0, 2.0], [3.0, 100.0]]),
        values=torch.tensor([[1.0, 2.0], [0.0, 9.0]]),
        returns=torch.tensor([[0.0, 2.0], [1.0, 0.0]]),
        reference_logprobs=logprobs.detach() - torch.tensor([[0.1, 0.2], [0.3, 5.0]]),
    )


def test_ppo_objective_sums_its_terms_as_computed_by_hand():
    settings = EstimatorConfig(
        policy_loss="ppo", clip_range=0.2, kl_estimator="k1", entropy_coef=0.01, value_loss_coef=0.5
    )
    batch = token_batch()
    out = unified_objective(batch, settings, kl_coef=0.5)
    # clipped surrogate per token: min(ρA, clip(ρ, 0.8, 1.2)A) = (1.2, −1, 2.4); token-mean, negated
    policy = -(1.2 - 1.0 + 2.4) / 3
    kl = (0.1 + 0.2 + 0.3) / 3  # k1 = log π − log π_ref
    value = (0.5 + 0.0 + 0.5) / 3  # ½ (V − R)²
    entropy = (1.0 + 2.0 + 3.0) / 3
    expected = policy + 0.5 * kl + 0.5 * value - 0.01 * entropy
    assert out.loss.item() == pytest.approx(expected)
    metrics = out.metrics
    assert metrics["policy_loss"] == pytest.approx(policy) and metrics["kl_to_reference"] == pytest.approx(kl)
    assert metrics["value_loss"] == pytest.approx(value) and metrics["entropy"] == pytest.approx(entropy)
    assert metrics["clip_fraction"] == pytest.approx(2 / 3) and metrics["loss"] == pytest.approx(expected)
    assert "importance_ess" not in metrics and not any(key.startswith("weights_") for key in metrics)
    out.loss.backward()
    # clipped tokens pass no policy gradient; the middle one passes −ρA/3 = 1/3; k1 adds 0.5/3 to every token
    assert torch.allclose(batch.logprobs.grad, torch.tensor([[1 / 6, 1 / 2], [1 / 6, 0.0]]))


def test_tensor_metrics_are_the_float_metrics_as_detached_tensors():
    settings = EstimatorConfig(
        policy_loss="ppo", off_policy_weight="truncated_is", kl_estimator="k1", entropy_coef=0.01, value_loss_coef=0.5
    )
    floats = unified_objective(token_batch(), settings, kl_coef=0.5, report_importance_ess=True).metrics
    tensors = unified_objective(
        token_batch(), settings, kl_coef=0.5, report_importance_ess=True, tensor_metrics=True
    ).metrics
    assert list(tensors) == list(floats)
    assert all(value.dim() == 0 and not value.requires_grad for value in tensors.values())
    assert {key: value.item() for key, value in tensors.items()} == floats


def test_kl_is_only_reported_at_zero_coefficient():
    settings = EstimatorConfig(policy_loss="ppo", kl_estimator="k1", entropy_coef=0.01, value_loss_coef=0.5)
    full = unified_objective(token_batch(), settings, kl_coef=0.5)
    no_kl = unified_objective(token_batch(), settings, kl_coef=0.0)
    assert no_kl.metrics["kl_to_reference"] == pytest.approx(0.2)
    assert no_kl.loss.item() == pytest.approx(full.loss.item() - 0.5 * 0.2)


def test_micro_batch_shares_use_the_mini_batch_denominators():
    mini = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    micro = mini[:2, :2]
    assert micro_batch_share(micro, mini, mode="token-mean", norm_length=None) == pytest.approx(3 / 6)
    assert micro_batch_share(micro, mini, mode="seq-mean-token-mean", norm_length=None) == pytest.approx(2 / 3)
    assert micro_batch_share(micro, mini, mode="seq-mean-token-sum-norm", norm_length=8) == pytest.approx(2 / 4 * 2 / 8)


def test_step_batches_are_one_token_sequences_weighted_by_age():
    settings = EstimatorConfig(policy_loss="vanilla", off_policy_weight="age_decay", sample_age_decay=0.5)
    logprobs = torch.log(torch.full((3,), 0.5))
    batch = ObjectiveBatch.from_steps(
        logprobs=logprobs, behaviour_logprobs=logprobs, advantages=torch.ones(3), age=torch.tensor([0.0, 1.0, 2.0])
    )
    assert batch.mask.shape == (3, 1) and batch.age.shape == (3, 1)
    out = unified_objective(batch, settings)
    weights = (1.0, 0.5, 0.25)  # γ_age^age
    assert out.loss.item() == pytest.approx(math.log(2) * sum(weights) / 3)  # −A · log π · w, token-mean
    assert out.metrics["weights_weight_mean"] == pytest.approx(sum(weights) / 3)
    assert out.metrics["approx_kl"] == 0.0  # π = μ; vanilla reports no approx_kl of its own
    assert set(out.metrics) >= {"policy_loss", "loss"} and "entropy" not in out.metrics


@pytest.fixture
def calls(monkeypatch):
    """Every call of ``unipg.learn.objective.unified_objective``, counted."""
    seen = []
    original = objective.unified_objective

    def counting(*args, **kwargs):
        seen.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(objective, "unified_objective", counting)
    return seen


def test_a_gym_update_goes_through_the_objective(calls):
    config = load_config(
        None,
        [
            "algorithm=ppo",
            "env.num_envs=2",
            "train.batch_transitions=32",
            "train.mini_batch_transitions=16",
            "train.num_epochs=2",
        ],
    )
    rollout = GymRollout("CartPole-v1", 2, seed=0, gamma=config.estimator.gamma)
    torch.manual_seed(0)
    policy = MLPActorCritic(rollout.observation_space, rollout.action_space, hidden_sizes=(16,))
    batch = rollout.collect(policy, 16, bootstrap=True)
    rollout.close()
    metrics = GradientLearner(policy, config).update(prepare_segment(policy, batch, config.estimator).samples)
    assert len(calls) == 4  # 2 epochs × 2 mini-batches of 16 steps
    # no reference policy: no KL coefficient; metrics kept as tensors, read once per update
    assert all(call == {"tensor_metrics": True} for call in calls)
    assert {"policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "grad_norm", "loss"} <= set(metrics)


def test_an_lm_update_goes_through_the_objective(calls, tiny_policy):
    policy = tiny_policy(needs_reference=True)
    learner = LMLearner(policy, make_config("grpo", "estimator.kl_coef=0.1", "train.micro_batch_size=8"))
    batch = make_batch(policy)
    learner.prepare(batch)
    metrics = learner.update(batch)
    assert len(calls) == 2  # 16 completions in micro-batches of 8
    assert all(call["kl_coef"] == pytest.approx(0.1) for call in calls)
    assert {"policy_loss", "kl_to_reference", "entropy", "approx_kl", "grad_norm", "loss"} <= set(metrics)


def test_top_entropy_quantile_keeps_the_policy_gradient_on_the_highest_entropy_tokens():
    # valid entropies (1, 2, 3): ρ = 0.5 keeps ⌈1.5⌉ = 2 tokens, entropies 2 and 3
    settings = EstimatorConfig(policy_loss="ppo", clip_range=0.2, kl_estimator="k1", top_entropy_quantile=0.5)
    batch = token_batch()
    out = unified_objective(batch, settings, kl_coef=0.5)
    policy = -(-1.0 + 2.4) / 2  # the clipped surrogate of those two tokens, averaged over them
    kl = (0.1 + 0.2 + 0.3) / 3  # the KL and value terms still read every valid token
    value = (0.5 + 0.0 + 0.5) / 3
    assert out.metrics["policy_loss"] == pytest.approx(policy)
    assert out.loss.item() == pytest.approx(policy + 0.5 * kl + 0.5 * value)
    out.loss.backward()
    # the first token (entropy 1) keeps only its KL gradient; the second passes −ρA/2 = 1/2 besides its KL
    assert torch.allclose(batch.logprobs.grad, torch.tensor([[0.5 / 3, 0.5 + 0.5 / 3], [0.5 / 3, 0.0]]))


def test_top_entropy_quantile_needs_the_entropy():
    settings = EstimatorConfig(policy_loss="vanilla", top_entropy_quantile=0.2)
    batch = ObjectiveBatch.from_steps(
        logprobs=torch.zeros(3), behaviour_logprobs=torch.zeros(3), advantages=torch.ones(3)
    )
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        unified_objective(batch, settings)


@pytest.mark.parametrize("policy_loss", ["vanilla", "ppo", "decoupled_ppo"])
def test_step_batches_take_plain_means_with_the_numbers_of_the_masked_ones(policy_loss):
    """A batch of environment steps (every step valid) reduces with plain means: loss, gradients and metrics are
    those of the same batch reduced over its all-ones mask."""
    settings = EstimatorConfig(policy_loss=policy_loss, value_clip_range=0.2, entropy_coef=0.01)
    generator = torch.Generator().manual_seed(0)

    def outputs(every_token_valid: bool):
        logprobs = torch.randn(8, generator=torch.Generator().manual_seed(1)).requires_grad_()
        values = torch.randn(8, generator=torch.Generator().manual_seed(2)).requires_grad_()
        batch = ObjectiveBatch.from_steps(
            logprobs=logprobs,
            behaviour_logprobs=logprobs.detach() + 0.3 * torch.randn(8, generator=generator.manual_seed(3)),
            proximal_logprobs=logprobs.detach() + 0.1,
            advantages=torch.randn(8, generator=generator.manual_seed(4)),
            entropy=torch.rand(8, generator=generator.manual_seed(5)),
            values=values,
            old_values=values.detach() + 0.5,
            returns=torch.randn(8, generator=generator.manual_seed(6)),
        )
        batch.every_token_valid = every_token_valid
        out = unified_objective(batch, settings)
        out.loss.backward()
        return out, logprobs.grad, values.grad

    plain, masked = outputs(True), outputs(False)
    torch.testing.assert_close(plain[0].loss, masked[0].loss)
    assert plain[0].metrics == pytest.approx(masked[0].metrics)
    torch.testing.assert_close(plain[1], masked[1])
    torch.testing.assert_close(plain[2], masked[2])
