"""CISPO and SAPO: hand examples from the papers' formulas and the limits where they reduce to known losses."""

from __future__ import annotations

import math

import pytest
import torch

from unipg.estimate.gated_losses import cispo_loss, sapo_gate, sapo_loss
from unipg.estimate.losses import policy_gradient_loss, ppo_clip_loss


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def logprobs_for(ratios) -> torch.Tensor:
    """log π_θ with behaviour log-probs 0, so that exp(log π_θ − log μ) equals the given ratios."""
    return torch.log(t(ratios)).requires_grad_(True)


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ------------------------------------------------------------------------------------------------
# CISPO


def test_cispo_hand_example_weight_is_clipped_and_its_gradient_stopped():
    ratios = [1.5, 0.5, 1.1]
    logprobs = logprobs_for([ratios])
    advantages = t([[1.0, -1.0, 2.0]])
    output = cispo_loss(logprobs, torch.zeros(1, 3), advantages, torch.ones(1, 3), clip_low=None, clip_high=0.2)
    weights = [1.2, 0.5, 1.1]  # ρ = 1.5 bounded at 1 + 0.2; no lower bound
    expected = -sum(w * a * math.log(r) for w, a, r in zip(weights, [1.0, -1.0, 2.0], ratios)) / 3
    assert output.loss.item() == pytest.approx(expected)
    output.loss.backward()
    # ∂/∂log π = −sg(clip ρ) · A / N: every token keeps a gradient, the clipped one included
    assert torch.allclose(logprobs.grad, t([[-1.2, 0.5, -2.2]]) / 3)
    assert output.metrics["clip_fraction"].item() == pytest.approx(1 / 3)
    assert output.metrics["ratio_max"].item() == pytest.approx(1.5)


def test_cispo_lower_bound():
    logprobs = logprobs_for([[0.5]])
    cispo_loss(logprobs, torch.zeros(1, 1), t([[1.0]]), torch.ones(1, 1), clip_low=0.2, clip_high=None).loss.backward()
    assert logprobs.grad.item() == pytest.approx(-0.8)


def test_cispo_keeps_the_gradient_of_tokens_ppo_clips():
    logprobs = logprobs_for([[1.5]])
    ppo_clip_loss(logprobs, torch.zeros(1, 1), t([[1.0]]), torch.ones(1, 1)).loss.backward()
    assert logprobs.grad.item() == 0.0
    logprobs.grad = None
    cispo_loss(logprobs, torch.zeros(1, 1), t([[1.0]]), torch.ones(1, 1), clip_high=0.2).loss.backward()
    assert logprobs.grad.item() == pytest.approx(-1.2)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_cispo_without_a_clip_is_reinforce_with_importance_weights(mode):
    generator = torch.Generator().manual_seed(1)
    behaviour = torch.randn(3, 5, generator=generator, dtype=torch.float64)
    start = behaviour + 0.8 * torch.randn(3, 5, generator=generator, dtype=torch.float64)
    advantages = torch.randn(3, 5, generator=generator, dtype=torch.float64)
    mask = t([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    cispo_logprobs, vanilla_logprobs = start.clone().requires_grad_(True), start.clone().requires_grad_(True)
    cispo = cispo_loss(cispo_logprobs, behaviour, advantages, mask, clip_low=None, clip_high=None, agg_mode=mode)
    ratio = torch.exp(start - behaviour)  # sg(ρ) as the off-policy weight w of the vanilla loss
    vanilla = policy_gradient_loss(vanilla_logprobs, advantages, mask, agg_mode=mode, weights=ratio)
    cispo.loss.backward()
    vanilla.loss.backward()
    assert cispo.loss.item() == pytest.approx(vanilla.loss.item())
    assert torch.allclose(cispo_logprobs.grad, vanilla_logprobs.grad)
    # and its gradient is the importance-sampled policy gradient −A ∇ρ of the unclipped surrogate (token-mean: / N)
    if mode == "token-mean":
        assert torch.allclose(cispo_logprobs.grad * mask.sum(), -(ratio * advantages * mask))


@pytest.mark.parametrize("kwargs", [{"clip_low": 1.5}, {"clip_low": -0.1}, {"clip_high": -0.1}])
def test_cispo_rejects_invalid_bounds(kwargs):
    with pytest.raises(ValueError, match="weight_clip"):
        cispo_loss(t([[0.0]]), t([[0.0]]), t([[1.0]]), t([[1.0]]), **kwargs)


# ------------------------------------------------------------------------------------------------
# SAPO


def test_sapo_hand_example_value_and_gradient():
    # token 0: ρ = 1.5, A = 1 → τ_pos = 1; token 1: ρ = 0.8, A = −2 → τ_neg = 1.05
    logprobs = logprobs_for([[1.5, 0.8]])
    advantages = t([[1.0, -2.0]])
    output = sapo_loss(logprobs, torch.zeros(1, 2), advantages, torch.ones(1, 2), tau_pos=1.0, tau_neg=1.05)
    gate0, gate1 = 4 * sigmoid(0.5), 4 / 1.05 * sigmoid(1.05 * -0.2)
    assert output.loss.item() == pytest.approx(-(gate0 * 1.0 + gate1 * -2.0) / 2)
    output.loss.backward()
    # −A ρ f'(ρ) / N with f'(ρ) = 4 σ(τ(ρ−1)) (1 − σ(τ(ρ−1)))
    slope0 = 4 * sigmoid(0.5) * (1 - sigmoid(0.5))
    slope1 = 4 * sigmoid(-0.21) * (1 - sigmoid(-0.21))
    assert torch.allclose(logprobs.grad, t([[-1.0 * 1.5 * slope0, 2.0 * 0.8 * slope1]]) / 2)
    assert output.metrics["gate_slope_mean"].item() == pytest.approx((slope0 + slope1) / 2)
    assert "clip_fraction" not in output.metrics


@pytest.mark.parametrize("tau", [0.5, 1.0, 5.0])
def test_sapo_on_policy_gradient_is_ppos_for_any_temperature(tau):
    advantages = t([[1.0, -0.5, 2.0]])
    sapo_logprobs, ppo_logprobs = t([[0.0] * 3]).requires_grad_(True), t([[0.0] * 3]).requires_grad_(True)
    sapo_loss(sapo_logprobs, torch.zeros(1, 3), advantages, torch.ones(1, 3), tau_pos=tau, tau_neg=tau).loss.backward()
    ppo_clip_loss(ppo_logprobs, torch.zeros(1, 3), advantages, torch.ones(1, 3)).loss.backward()
    assert torch.allclose(sapo_logprobs.grad, ppo_logprobs.grad)


def test_sapo_gate_limits_no_trust_region_as_tau_goes_to_zero_a_vanishing_one_as_it_grows():
    ratio = t([0.5, 0.9, 1.0, 1.1, 2.0]).requires_grad_(True)
    slopes = {}
    for tau in (1e-6, 1.0, 50.0):
        (slope,) = torch.autograd.grad(sapo_gate(ratio, tau).sum(), ratio)
        slopes[tau] = slope
    # τ → 0: slope 1 everywhere, the unclipped surrogate ρA (PPO with an infinite clip)
    assert torch.allclose(slopes[1e-6], t([1.0] * 5), atol=1e-9)
    # any τ: slope 1 at ρ = 1 and < 1 elsewhere, falling the faster the larger τ
    assert all(slopes[tau][2].item() == pytest.approx(1.0) for tau in slopes)
    assert torch.all(slopes[50.0][[0, 1, 3, 4]] < slopes[1.0][[0, 1, 3, 4]])
    # τ → ∞: the gate lets no off-policy token through, as a hard clip whose range shrinks to 0
    assert torch.all(slopes[50.0][[0, 4]] < 1e-9)


def test_sapo_is_finite_for_extreme_ratios():
    logprobs = t([[80.0, -80.0]]).requires_grad_(True)
    output = sapo_loss(logprobs, torch.zeros(1, 2), t([[1.0, -1.0]]), torch.ones(1, 2))
    output.loss.backward()
    assert math.isfinite(output.loss.item()) and torch.isfinite(logprobs.grad).all()


def test_sapo_rejects_a_non_positive_temperature():
    with pytest.raises(ValueError, match="sapo_tau_pos"):
        sapo_loss(t([[0.0]]), t([[0.0]]), t([[1.0]]), t([[1.0]]), tau_pos=0.0)
