"""Clip-Cov and KL-Cov: the covariance selection on hand-written tensors, and PPO / the unclipped surrogate where
nothing is selected."""

from __future__ import annotations

import pytest
import torch

from unipg.estimate.covariance_losses import clip_cov_loss, kl_cov_loss, token_covariance
from unipg.estimate.losses import ppo_clip_loss


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# log π = (−1, −1, −1, −1, −3), A = (0, 0, 0, 0, −5) → means −1.4 and −1;
# cov = (A − (−1)) (log π − (−1.4)) = (0.4, 0.4, 0.4, 0.4, 6.4); padding −inf
LOGPROBS = t([[-1.0, -1.0, -1.0, -1.0, -3.0, 0.0]])
ADVANTAGES = t([[0.0, 0.0, 0.0, 0.0, -5.0, 9.0]])
MASK = t([[1, 1, 1, 1, 1, 0]])


def test_token_covariance_hand_example():
    expected = t([[0.4, 0.4, 0.4, 0.4, 6.4, -float("inf")]])
    torch.testing.assert_close(token_covariance(LOGPROBS, ADVANTAGES, MASK), expected)


def test_clip_cov_drops_the_gradient_of_a_token_inside_the_covariance_band():
    logprobs = LOGPROBS.clone().requires_grad_(True)
    behaviour = LOGPROBS - 0.05  # ρ = e^0.05 inside the PPO clip: PPO drops nothing
    # band (0.1, 1): the four tokens with cov 0.4 are candidates; share 0.2 of 5 tokens → 1 dropped
    output = clip_cov_loss(
        logprobs, behaviour, ADVANTAGES + 1.0, MASK, share=0.2, lower=0.1, upper=1.0, generator=torch.Generator()
    )
    output.loss.backward()
    dropped = (logprobs.grad == 0) & MASK.bool()
    assert int(dropped.sum()) == 1 and bool(dropped[0, :4].any())
    assert output.metrics["cov_clip_fraction"].item() == pytest.approx(1 / 5)


def test_clip_cov_draw_is_reproducible_with_a_seeded_generator():
    def dropped(seed):
        logprobs = LOGPROBS.clone().requires_grad_(True)
        clip_cov_loss(
            logprobs,
            LOGPROBS,
            ADVANTAGES + 1.0,  # the same covariance, and no zero advantage
            MASK,
            share=0.4,
            lower=0.1,
            upper=1.0,
            generator=torch.Generator().manual_seed(seed),
        ).loss.backward()
        return (logprobs.grad == 0) & MASK.bool()

    assert torch.equal(dropped(7), dropped(7)) and int(dropped(7).sum()) == 2


def test_clip_cov_is_ppo_when_no_token_is_in_the_band():
    generator = torch.Generator().manual_seed(2)
    behaviour = torch.randn(3, 4, generator=generator, dtype=torch.float64)
    start = behaviour + 0.4 * torch.randn(3, 4, generator=generator, dtype=torch.float64)
    advantages = torch.randn(3, 4, generator=generator, dtype=torch.float64)
    mask = torch.ones(3, 4)
    outputs, grads = [], []
    for loss, extra in ((clip_cov_loss, {"lower": 100.0, "upper": 200.0}), (ppo_clip_loss, {})):
        logprobs = start.clone().requires_grad_(True)
        outputs.append(loss(logprobs, behaviour, advantages, mask, clip_low=0.2, **extra))
        outputs[-1].loss.backward()
        grads.append(logprobs.grad)
    assert outputs[0].loss.item() == pytest.approx(outputs[1].loss.item()) and torch.allclose(*grads)
    assert outputs[0].metrics["cov_clip_fraction"].item() == 0.0


def test_kl_cov_penalises_the_token_of_largest_covariance():
    logprobs = LOGPROBS.clone().requires_grad_(True)
    behaviour = LOGPROBS - t([[0.1, 0.1, 0.1, 0.1, -0.2, 0.0]])  # log ρ = 0.1 ×4, −0.2 on the top-cov token
    output = kl_cov_loss(logprobs, behaviour, ADVANTAGES, MASK, share=0.2, coef=2.0)
    rho = torch.exp(t([0.1, 0.1, 0.1, 0.1, -0.2]))
    advantages = ADVANTAGES[0, :5]
    # −ρA on every token, + β |log ρ| = 2 · 0.2 on token 4 only; token mean over 5
    assert output.loss.item() == pytest.approx(((-rho * advantages).sum().item() + 2.0 * 0.2) / 5)
    output.loss.backward()
    # ∂/∂log π: −ρA, and on token 4 + β · sign(log ρ) = −2
    expected = torch.cat([-rho * advantages + t([0, 0, 0, 0, -2.0]), t([0.0])]) / 5
    assert torch.allclose(logprobs.grad[0], expected)
    assert output.metrics["kl_cov_fraction"].item() == pytest.approx(1 / 5)


def test_covariance_losses_reject_bad_settings():
    args = (t([[0.0]]), t([[0.0]]), t([[1.0]]), t([[1.0]]))
    with pytest.raises(ValueError, match="clip_cov_lb"):
        clip_cov_loss(*args, lower=5.0, upper=1.0)
    with pytest.raises(ValueError, match="kl_cov_ratio"):
        kl_cov_loss(*args, share=0.0)
