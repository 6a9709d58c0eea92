"""Loss aggregation, policy losses (PG, PPO-clip, dual-clip, decoupled PPO), value loss, entropy."""

from __future__ import annotations

import math

import pytest
import torch

from unipg.estimate.losses import (
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    aggregate,
    decoupled_ppo_loss,
    entropy_from_logits,
    explained_variance,
    policy_gradient_loss,
    ppo_clip_loss,
    value_loss,
)
from unipg.registry import RegistryError


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def logprobs_for(ratios) -> torch.Tensor:
    """log π_θ with behaviour log-probs 0, so that exp(log π_θ − log μ) equals the given ratios."""
    return torch.log(t(ratios)).requires_grad_(True)


# ------------------------------------------------------------------------------------------------
# Aggregation on a hand-written 3×3 tensor with a ragged mask

VALUES = t([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
RAGGED = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 22 / 6),  # (1+2+3+4+5+7) / 6 valid tokens
        ("seq-mean-token-mean", (2 + 4.5 + 7) / 3),  # per-row means 2, 4.5, 7
        ("seq-mean-token-sum", (6 + 9 + 7) / 3),  # per-row sums 6, 9, 7
        ("seq-mean-token-sum-norm", 22 / (3 * 3)),  # Σ / (B · T)
    ],
)
def test_aggregation_modes_hand_example(mode, expected):
    assert aggregate(VALUES, RAGGED, mode=mode).item() == pytest.approx(expected)


def test_token_sum_norm_uses_given_norm_length():
    result = aggregate(VALUES, RAGGED, mode="seq-mean-token-sum-norm", norm_length=4)
    assert result.item() == pytest.approx(22 / 12)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 10 / 3),
        ("seq-mean-token-mean", (1.5 + 7) / 2),  # the empty row is left out
        ("seq-mean-token-sum", (3 + 7) / 2),
        ("seq-mean-token-sum-norm", 10 / 9),
    ],
)
def test_aggregation_with_an_empty_row_has_no_nan_in_value_or_gradient(mode, expected):
    values = VALUES.clone().requires_grad_(True)
    mask = torch.tensor([[True, True, False], [False, False, False], [True, False, False]])
    result = aggregate(values, mask, mode=mode)
    result.backward()
    assert result.item() == pytest.approx(expected)
    assert torch.isfinite(values.grad).all() and torch.all(values.grad[1] == 0)


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_aggregation_of_an_all_padding_batch_is_zero(mode):
    assert aggregate(VALUES, torch.zeros(3, 3), mode=mode).item() == 0.0


def test_unknown_aggregation_mode_lists_valid_modes():
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-mean"):
        aggregate(VALUES, RAGGED, mode="token_mean")


# ------------------------------------------------------------------------------------------------
# Vanilla policy gradient


def test_policy_gradient_loss_hand_example_and_constant_advantages():
    logprobs = t([[-1.0, -2.0, -0.5]]).requires_grad_(True)
    advantages = t([[1.0, -2.0, 0.5]]).requires_grad_(True)
    mask = t([[1, 1, 0]])
    output = policy_gradient_loss(logprobs, advantages, mask)
    # −(1·(−1) + (−2)·(−2)) / 2 = −1.5
    assert output.loss.item() == pytest.approx(-1.5)
    output.loss.backward()
    assert torch.allclose(logprobs.grad, t([[-0.5, 1.0, 0.0]]))
    assert advantages.grad is None


# ------------------------------------------------------------------------------------------------
# PPO-clip


def test_ppo_hand_example_and_metrics():
    ratios = [[1.5, 0.5, 1.1]]
    advantages = t([[1.0, -1.0, 2.0]])
    output = ppo_clip_loss(logprobs_for(ratios), torch.zeros(1, 3), advantages, torch.ones(1, 3), clip_low=0.2)
    # min(1.5, 1.2)·1 = 1.2; min(−0.5, −0.8) = −0.8; min(2.2, 2.2) = 2.2
    assert output.loss.item() == pytest.approx(-(1.2 - 0.8 + 2.2) / 3)
    metrics = output.metrics
    assert metrics["clip_fraction"].item() == pytest.approx(2 / 3)
    assert metrics["ratio_mean"].item() == pytest.approx(3.1 / 3)
    assert metrics["ratio_max"].item() == pytest.approx(1.5)
    k3 = sum((r - 1) - math.log(r) for r in ratios[0]) / 3
    assert metrics["approx_kl"].item() == pytest.approx(k3)
    assert all(not value.requires_grad and value.dim() == 0 for value in metrics.values())


def test_ppo_gradient_is_zero_on_the_clipped_side_only():
    # A>0 & ρ>1+ε | A<0 & ρ<1−ε | inside | A>0 & ρ<1−ε | A<0 & ρ>1+ε
    ratios = [[1.5, 0.5, 1.1, 0.5, 1.5]]
    advantages = t([[1.0, -1.0, 2.0, 1.0, -1.0]])
    logprobs = logprobs_for(ratios)
    ppo_clip_loss(logprobs, torch.zeros(1, 5), advantages, torch.ones(1, 5), clip_low=0.2).loss.backward()
    # d(−ρA/5)/d log π = −ρA/5 where the unclipped term is active
    assert torch.allclose(logprobs.grad, t([[0.0, 0.0, -2.2 / 5, -0.5 / 5, 1.5 / 5]]))


def test_ppo_asymmetric_clip_honours_low_and_high():
    ratios = [[1.25, 0.79]]
    advantages = t([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    symmetric = ppo_clip_loss(logprobs_for(ratios), torch.zeros(1, 2), advantages, mask, clip_low=0.2)
    assert symmetric.loss.item() == pytest.approx(-(1.2 - 0.8) / 2)  # both tokens clipped
    logprobs = logprobs_for(ratios)
    clip_higher = ppo_clip_loss(logprobs, torch.zeros(1, 2), advantages, mask, clip_low=0.2, clip_high=0.28)
    # ρ = 1.25 < 1.28 is inside the wider upper bound; ρ = 0.79 < 0.8 is still clipped below
    assert clip_higher.loss.item() == pytest.approx(-(1.25 - 0.8) / 2)
    assert clip_higher.metrics["clip_fraction"].item() == pytest.approx(0.5)
    clip_higher.loss.backward()
    assert logprobs.grad[0, 0] != 0 and logprobs.grad[0, 1] == 0


def test_dual_clip_bounds_the_loss_for_negative_advantages():
    ratios = [[10.0, 10.0]]
    advantages = t([[-1.0, 1.0]])
    mask = torch.ones(1, 2)
    plain = ppo_clip_loss(logprobs_for(ratios), torch.zeros(1, 2), advantages, mask, clip_low=0.2)
    assert plain.loss.item() == pytest.approx((10.0 - 1.2) / 2)  # ρA = −10 is unbounded below
    logprobs = logprobs_for(ratios)
    dual = ppo_clip_loss(logprobs, torch.zeros(1, 2), advantages, mask, clip_low=0.2, dual_clip=3.0)
    # A<0: max(min(−10, −1.2), 3·(−1)) = −3; A>0 is untouched: min(10, 1.2) = 1.2
    assert dual.loss.item() == pytest.approx((3.0 - 1.2) / 2)
    assert dual.metrics["dual_clip_fraction"].item() == pytest.approx(0.5)
    assert dual.metrics["clip_fraction"].item() == pytest.approx(0.5)
    dual.loss.backward()
    assert torch.all(logprobs.grad == 0)


def test_dual_clip_does_not_change_moderate_ratios():
    logprobs, advantages = logprobs_for([[2.0, 0.5]]), t([[-1.0, -1.0]])
    args = (logprobs, torch.zeros(1, 2), advantages, torch.ones(1, 2))
    plain, dual = ppo_clip_loss(*args), ppo_clip_loss(*args, dual_clip=3.0)
    assert dual.loss.item() == pytest.approx(plain.loss.item())
    assert dual.metrics["dual_clip_fraction"].item() == 0.0


@pytest.mark.parametrize("kwargs", [{"dual_clip": 1.0}, {"clip_low": 1.0}, {"clip_low": -0.1}, {"clip_high": -0.1}])
def test_ppo_rejects_invalid_clip_settings(kwargs):
    with pytest.raises(ValueError):
        ppo_clip_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), **kwargs)


def test_ppo_metrics_ignore_padding():
    logprobs = logprobs_for([[1.1, 50.0]])
    output = ppo_clip_loss(logprobs, torch.zeros(1, 2), t([[1.0, 1.0]]), t([[1, 0]]))
    assert output.metrics["ratio_max"].item() == pytest.approx(1.1)
    assert output.metrics["clip_fraction"].item() == 0.0


def test_weights_multiply_the_per_token_loss():
    logprobs = logprobs_for([[1.0, 1.0, 1.0]])
    weights = t([[0.0, 1.0, 0.5]]).requires_grad_(True)
    output = ppo_clip_loss(logprobs, torch.zeros(1, 3), t([[3.0, 2.0, 4.0]]), torch.ones(1, 3), weights=weights)
    assert output.loss.item() == pytest.approx(-(0 + 2.0 + 2.0) / 3)
    output.loss.backward()
    assert weights.grad is None and logprobs.grad[0, 0] == 0


# ------------------------------------------------------------------------------------------------
# Decoupled PPO


def test_decoupled_ppo_equals_ppo_when_proximal_is_behaviour():
    generator = torch.Generator().manual_seed(0)
    behaviour = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    advantages = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    mask = torch.rand(4, 6, generator=generator) > 0.3
    start = behaviour + 0.3 * torch.randn(4, 6, generator=generator, dtype=torch.float64)
    plain_logprobs = start.clone().requires_grad_(True)
    decoupled_logprobs = start.clone().requires_grad_(True)
    clip = {"clip_low": 0.2, "clip_high": 0.3}
    plain = ppo_clip_loss(plain_logprobs, behaviour, advantages, mask, **clip)
    decoupled = decoupled_ppo_loss(decoupled_logprobs, behaviour, behaviour, advantages, mask, **clip)
    plain.loss.backward()
    decoupled.loss.backward()
    assert decoupled.loss.item() == pytest.approx(plain.loss.item())
    assert torch.allclose(decoupled_logprobs.grad, plain_logprobs.grad)
    for name, value in plain.metrics.items():
        assert decoupled.metrics[name].item() == pytest.approx(value.item())


def test_decoupled_ppo_clips_against_proximal_and_weights_by_proximal_over_behaviour():
    proximal = t([[0.0, 0.0]])
    behaviour = proximal - math.log(2.0)  # π_prox / μ = 2
    logprobs = logprobs_for([[1.5, 1.1]])  # ratios against π_prox
    output = decoupled_ppo_loss(logprobs, proximal, behaviour, t([[1.0, 1.0]]), torch.ones(1, 2), clip_low=0.2)
    # 2 · min(1.5, 1.2) and 2 · 1.1, averaged
    assert output.loss.item() == pytest.approx(-2 * (1.2 + 1.1) / 2)
    assert output.metrics["behaviour_weight_mean"].item() == pytest.approx(2.0)
    assert output.metrics["clip_fraction"].item() == pytest.approx(0.5)


def test_registered_policy_losses():
    assert set(POLICY_LOSSES.names()) == {
        "vanilla",
        "ppo",
        "decoupled_ppo",
        "gspo",
        "gspo_token",
        "gmpo",
        "luspo",
        "vespo",
        "cispo",
        "sapo",
        "clip_cov",
        "kl_cov",
    }
    assert POLICY_LOSSES.get("ppo") is ppo_clip_loss
    with pytest.raises(RegistryError, match="gspo, gspo_token, kl_cov, luspo, ppo, sapo, vanilla, vespo"):
        POLICY_LOSSES.get("ppo2")
    with pytest.raises(RegistryError, match="already registered"):
        POLICY_LOSSES.register("ppo")(lambda: None)


# ------------------------------------------------------------------------------------------------
# Value loss and explained variance


def test_value_loss_hand_example():
    output = value_loss(t([[1, 2, 3]]), t([[2, 2, 0]]), t([[1, 1, 1]]))
    assert output.loss.item() == pytest.approx(0.5 * (1 + 0 + 9) / 3)
    assert output.metrics == {}


def test_clipped_value_loss_takes_the_larger_error_and_reports_clip_fraction():
    values = t([[1.0, 2.0, 3.0]]).requires_grad_(True)
    old_values, returns = t([[0.0, 2.0, 3.0]]), t([[1.0, 2.0, 3.0]])
    output = value_loss(values, returns, torch.ones(1, 3), old_values=old_values, clip_range=0.2)
    # token 0: V moved 1 from V_old; clipped V = 0.2, error (0.2 − 1)² = 0.64 beats 0
    assert output.loss.item() == pytest.approx(0.5 * 0.64 / 3)
    assert output.metrics["value_clip_fraction"].item() == pytest.approx(1 / 3)
    output.loss.backward()
    assert values.grad[0, 0] == 0  # the clipped value does not move with V


def test_clipped_value_loss_needs_old_values():
    with pytest.raises(ValueError, match="old_values"):
        value_loss(t([[1.0]]), t([[1.0]]), t([[1]]), clip_range=0.2)


def test_explained_variance():
    returns, mask = t([[1, 2, 3, 4]]), t([[1, 1, 1, 1]])
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 2.5), returns, mask).item() == pytest.approx(0.0)
    # padding is ignored: the padded value 100 would otherwise ruin the fit
    padded_values, padded_returns = t([[1, 2, 100]]), t([[1, 2, 0]])
    assert explained_variance(padded_values, padded_returns, t([[1, 1, 0]])).item() == pytest.approx(1.0)
    constant = explained_variance(t([[0, 1, 2]]), t([[3, 3, 3]]), t([[1, 1, 1]]))
    assert constant.item() == 0.0 and torch.isfinite(constant)


# ------------------------------------------------------------------------------------------------
# Entropy


def test_entropy_of_uniform_logits_is_log_vocab_size():
    entropy = entropy_from_logits(torch.zeros(2, 3, 7))
    assert entropy.shape == (2, 3)
    assert torch.allclose(entropy, torch.full((2, 3), math.log(7)))


def test_entropy_hand_example_and_large_logits():
    probabilities = t([0.5, 0.25, 0.25])
    assert entropy_from_logits(torch.log(probabilities)).item() == pytest.approx(1.5 * math.log(2))
    assert entropy_from_logits(t([1000.0, 1000.0])).item() == pytest.approx(math.log(2))


def test_entropy_with_masked_vocabulary_has_no_nan_in_value_or_gradient():
    logits = t([[0.0, 0.0, -math.inf, -math.inf], [1.0, 2.0, 3.0, -math.inf]]).requires_grad_(True)
    entropy = entropy_from_logits(logits)
    assert entropy[0].item() == pytest.approx(math.log(2))
    entropy.sum().backward()
    assert torch.isfinite(entropy).all() and torch.isfinite(logits.grad).all()
    assert torch.all(logits.grad[:, 3] == 0)


def test_decoupled_ppo_caps_the_behaviour_weight():
    logprobs = torch.zeros(1, 3)
    behaviour = torch.tensor([[0.0, -3.0, 0.0]])  # the middle token: π_prox/μ = e³ ≈ 20
    proximal, advantages, mask = torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3)
    free = decoupled_ppo_loss(logprobs, proximal, behaviour, advantages, mask)
    capped = decoupled_ppo_loss(logprobs, proximal, behaviour, advantages, mask, behaviour_weight_cap=5.0)
    assert free.loss.item() == pytest.approx(-(1 + math.exp(3) + 1) / 3)
    assert capped.loss.item() == pytest.approx(-(1 + 5 + 1) / 3)
    assert capped.metrics["behaviour_weight_capped"].item() == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="behaviour_weight_cap"):
        decoupled_ppo_loss(logprobs, proximal, behaviour, advantages, mask, behaviour_weight_cap=0.0)
