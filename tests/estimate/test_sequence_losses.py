"""Sequence-level ratio losses: GSPO, GSPO-token, GMPO, LUSPO, VESPO — hand examples from the papers' formulas and
the limits where they reduce to PPO-clip, GSPO or REINFORCE."""

from __future__ import annotations

import math

import pytest
import torch

from unipg.estimate import POLICY_LOSSES
from unipg.estimate.losses import policy_gradient_loss, ppo_clip_loss
from unipg.estimate.sequence_losses import gmpo_loss, gspo_loss, gspo_token_loss, luspo_loss, vespo_kernel, vespo_loss


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def random_batch(seed: int, shape=(4, 6), scale=0.3):
    generator = torch.Generator().manual_seed(seed)
    behaviour = torch.randn(*shape, generator=generator, dtype=torch.float64)
    logprobs = (behaviour + scale * torch.randn(*shape, generator=generator, dtype=torch.float64)).requires_grad_(True)
    advantages = torch.randn(shape[0], 1, generator=generator, dtype=torch.float64).expand(*shape).clone()
    mask = torch.ones(shape, dtype=torch.float64)
    mask[0, 4:] = 0
    mask[2, 1:] = 0
    return logprobs, behaviour, advantages, mask


def value_and_grad(loss_fn, logprobs, *args, **kwargs):
    logprobs = logprobs.detach().clone().requires_grad_(True)
    output = loss_fn(logprobs, *args, **kwargs)
    output.loss.backward()
    return output.loss.item(), logprobs.grad


# ------------------------------------------------------------------------------------------------
# GSPO


def test_gspo_hand_example_value_and_gradient():
    # row 0: log ρ = (0.1, −0.3), A = 1 → s = e^−0.1 ≈ 0.905, inside [0.8, 1.2]
    # row 1: log ρ = 0.2 (one token), A = −1 → s = e^0.2 ≈ 1.221 > 1.2, but for A < 0 the unclipped side is kept
    logprobs = t([[0.1, -0.3, 9.0], [0.2, 0.0, 0.0]]).requires_grad_(True)
    mask = t([[1, 1, 0], [1, 0, 0]])
    advantages = t([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    output = gspo_loss(logprobs, torch.zeros(2, 3), advantages, mask, clip_low=0.2, clip_high=0.2)
    s0, s1 = math.exp(-0.1), math.exp(0.2)
    assert output.loss.item() == pytest.approx(-(s0 * 1.0 + s1 * -1.0) / 2)
    output.loss.backward()
    # ∂/∂log π_t of −s_i A_i / B: −s_i A_i · (1/|y_i|) / B, the same on every token of a response
    expected = t([[-s0 / 2 / 2, -s0 / 2 / 2, 0.0], [s1 / 2, 0.0, 0.0]])
    assert torch.allclose(logprobs.grad, expected)
    assert output.metrics["clip_fraction"].item() == 0.0
    assert output.metrics["ratio_max"].item() == pytest.approx(s1)
    k3 = [math.expm1(x) - x for x in (0.1, -0.3, 0.2)]
    assert output.metrics["approx_kl"].item() == pytest.approx(sum(k3) / 3)


def test_gspo_clips_the_whole_response_on_its_sequence_ratio():
    # log ρ = (0.5, −0.1): s = e^0.2 > 1.2 with A > 0 → clipped, no gradient on any token of the response
    logprobs = t([[0.5, -0.1]]).requires_grad_(True)
    output = gspo_loss(logprobs, torch.zeros(1, 2), t([[2.0, 2.0]]), torch.ones(1, 2), clip_low=0.2, clip_high=0.2)
    assert output.loss.item() == pytest.approx(-1.2 * 2.0)
    output.loss.backward()
    assert torch.all(logprobs.grad == 0)
    assert output.metrics["clip_fraction"].item() == 1.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_gspo_with_one_token_responses_is_ppo_clip(mode, dual_clip):
    generator = torch.Generator().manual_seed(3)
    behaviour = torch.randn(16, 1, generator=generator, dtype=torch.float64)
    logprobs = behaviour + 0.5 * torch.randn(16, 1, generator=generator, dtype=torch.float64)
    advantages = torch.randn(16, 1, generator=generator, dtype=torch.float64)
    args = (behaviour, advantages, torch.ones(16, 1))
    options = {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": dual_clip, "agg_mode": mode}
    gspo_value, gspo_grad = value_and_grad(gspo_loss, logprobs, *args, **options)
    ppo_value, ppo_grad = value_and_grad(ppo_clip_loss, logprobs, *args, **options)
    assert gspo_value == pytest.approx(ppo_value) and torch.allclose(gspo_grad, ppo_grad)


def test_gspo_token_equals_gspo_when_the_advantage_is_constant_along_each_response():
    logprobs, behaviour, advantages, mask = random_batch(0, scale=0.1)
    options = {"clip_low": 0.02, "clip_high": 0.03}  # narrow enough that some responses are clipped
    sequence_value, sequence_grad = value_and_grad(gspo_loss, logprobs, behaviour, advantages, mask, **options)
    token_value, token_grad = value_and_grad(gspo_token_loss, logprobs, behaviour, advantages, mask, **options)
    assert token_value == pytest.approx(sequence_value) and torch.allclose(token_grad, sequence_grad)
    assert (sequence_grad == 0).all(-1).any() and not (sequence_grad == 0).all()


def test_gspo_token_weighs_each_token_by_its_own_advantage_and_the_sequence_ratio():
    logprobs = t([[0.1, -0.1, 0.3]]).requires_grad_(True)
    behaviour = t([[0.0, 0.0, 0.2]])  # log ρ = (0.1, −0.1, 0.1) → s = e^{0.1/3}
    advantages = t([[1.0, -2.0, 0.5]])
    output = gspo_token_loss(logprobs, behaviour, advantages, torch.ones(1, 3), clip_low=0.2, clip_high=0.2)
    s = math.exp(0.1 / 3)
    assert output.loss.item() == pytest.approx(-s * (1.0 - 2.0 + 0.5) / 3)
    output.loss.backward()
    assert torch.allclose(logprobs.grad, -s * advantages / 3)


def test_gspo_presets_default_to_the_papers_narrow_clip():
    logprobs = t([[0.001]])
    assert gspo_loss(logprobs, t([[0.0]]), t([[1.0]]), t([[1.0]])).metrics["clip_fraction"].item() == 1.0
    assert POLICY_LOSSES.options("gspo") == ["clip_range", "clip_range_high", "dual_clip", "loss_agg_mode"]


# ------------------------------------------------------------------------------------------------
# LUSPO


def test_luspo_hand_example_scales_each_response_by_its_length():
    # GSPO's hand example: row 0 (2 tokens) s = e^−0.1, A = 1; row 1 (1 token) s = e^0.2, A = −1 (unclipped side)
    logprobs = t([[0.1, -0.3, 9.0], [0.2, 0.0, 0.0]]).requires_grad_(True)
    mask = t([[1, 1, 0], [1, 0, 0]])
    advantages = t([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    output = luspo_loss(logprobs, torch.zeros(2, 3), advantages, mask, clip_low=0.2, clip_high=0.2)
    s0, s1 = math.exp(-0.1), math.exp(0.2)
    assert output.loss.item() == pytest.approx(-(2 * s0 * 1.0 + 1 * s1 * -1.0) / 2)
    output.loss.backward()
    # −|y_i| s_i A_i · (1/|y_i|) / B = −s_i A_i / B on every token, whatever the response's length
    assert torch.allclose(logprobs.grad, t([[-s0 / 2, -s0 / 2, 0.0], [s1 / 2, 0.0, 0.0]]))
    assert output.metrics["clip_fraction"].item() == 0.0


def test_luspo_is_gspo_summed_over_each_responses_tokens():
    logprobs, behaviour, advantages, mask = random_batch(1, scale=0.1)
    options = {"clip_low": 0.02, "clip_high": 0.03}
    luspo = value_and_grad(luspo_loss, logprobs, behaviour, advantages, mask, **options)
    gspo = value_and_grad(gspo_loss, logprobs, behaviour, advantages, mask, agg_mode="seq-mean-token-sum", **options)
    assert luspo[0] == pytest.approx(gspo[0]) and torch.allclose(luspo[1], gspo[1])
    equal_lengths = torch.ones_like(mask)  # every response 6 tokens long: LUSPO = 6 × GSPO
    luspo = value_and_grad(luspo_loss, logprobs, behaviour, advantages, equal_lengths, **options)
    gspo = value_and_grad(gspo_loss, logprobs, behaviour, advantages, equal_lengths, **options)
    assert luspo[0] == pytest.approx(6 * gspo[0]) and torch.allclose(luspo[1], 6 * gspo[1])


# ------------------------------------------------------------------------------------------------
# VESPO


def test_vespo_hand_example_value_and_gradient():
    # row 0: log ρ = (0.1, −0.3) → W = e^−0.2, A = +1 → φ = W² e^{3(1−W)}
    # row 1: log ρ = 0.2 (one token) → W = e^0.2, A = −1 → φ = W³ e^{2(1−W)}
    logprobs = t([[0.1, -0.3, 9.0], [0.2, 0.0, 0.0]]).requires_grad_(True)
    mask = t([[1, 1, 0], [1, 0, 0]])
    advantages = t([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    output = vespo_loss(logprobs, torch.zeros(2, 3), advantages, mask)
    w0, w1 = math.exp(-0.2), math.exp(0.2)
    phi0, phi1 = w0**2 * math.exp(3 * (1 - w0)), w1**3 * math.exp(2 * (1 - w1))
    # token-mean of −φ_i A_t log π_t over the 3 valid tokens
    assert output.loss.item() == pytest.approx(-(phi0 * (0.1 - 0.3) + phi1 * -1.0 * 0.2) / 3)
    output.loss.backward()
    assert torch.allclose(logprobs.grad, t([[-phi0 / 3, -phi0 / 3, 0.0], [phi1 / 3, 0.0, 0.0]]))
    assert output.metrics["kernel_mean"].item() == pytest.approx((phi0 + phi1) / 2)
    assert output.metrics["ratio_max"].item() == pytest.approx(w1)


def test_vespo_on_policy_is_reinforce():
    logprobs, _, advantages, mask = random_batch(2)
    behaviour = logprobs.detach().clone()  # W = 1, φ(1) = 1
    vespo = value_and_grad(vespo_loss, logprobs, behaviour, advantages, mask)
    reinforce = value_and_grad(policy_gradient_loss, logprobs, advantages, mask)
    assert vespo[0] == pytest.approx(reinforce[0]) and torch.allclose(vespo[1], reinforce[1])


def test_vespo_kernel_peaks_at_k_over_lambda_and_fades_far_off_policy():
    ratios = t([1e-6, 0.5, 2.0 / 3.0, 1.0, 2.0, 20.0])
    kernel = vespo_kernel(ratios, 2.0, 3.0)
    assert kernel[3].item() == pytest.approx(1.0)
    assert kernel.argmax().item() == 2  # W = k/λ
    assert kernel[0].item() < 1e-10 and kernel[-1].item() < 1e-20
    with pytest.raises(ValueError, match="must be ≥ 0"):
        vespo_loss(t([[0.0]]), t([[0.0]]), t([[1.0]]), t([[1.0]]), k_neg=-1.0)


# ------------------------------------------------------------------------------------------------
# GMPO


def test_gmpo_hand_example_geometric_mean_of_token_clipped_ratios():
    # row 0, A = +1: log ρ = (0.5, −0.1) → kept (0.4, −0.1), mean 0.15; token 0 clipped (no gradient)
    # row 1, A = −2: log ρ = (0.5, −0.6) → kept (0.5, −0.4), mean 0.05; token 1 clipped
    logprobs = t([[0.5, -0.1], [0.5, -0.6]]).requires_grad_(True)
    advantages = t([[1.0, 1.0], [-2.0, -2.0]])
    output = gmpo_loss(logprobs, torch.zeros(2, 2), advantages, torch.ones(2, 2), clip_low=0.4, clip_high=0.4)
    j0, j1 = math.exp(0.15), -2.0 * math.exp(0.05)
    assert output.loss.item() == pytest.approx(-(j0 + j1) / 2)
    output.loss.backward()
    # −∂J_i/∂log π_t / B = −A_i · e^{mean} · (1/|y_i|) / B on unclipped tokens
    expected = t([[0.0, -j0 / 2 / 2], [2.0 * math.exp(0.05) / 2 / 2, 0.0]])
    assert torch.allclose(logprobs.grad, expected)
    assert output.metrics["clip_fraction"].item() == pytest.approx(0.5)


def test_gmpo_with_one_token_responses_is_ppo_clip_with_log_space_bounds():
    generator = torch.Generator().manual_seed(5)
    behaviour = torch.randn(16, 1, generator=generator, dtype=torch.float64)
    logprobs = behaviour + 0.6 * torch.randn(16, 1, generator=generator, dtype=torch.float64)
    advantages = torch.randn(16, 1, generator=generator, dtype=torch.float64)
    args = (behaviour, advantages, torch.ones(16, 1))
    gmpo = value_and_grad(gmpo_loss, logprobs, *args, clip_low=0.4, clip_high=0.3)
    ppo = value_and_grad(ppo_clip_loss, logprobs, *args, clip_low=1 - math.exp(-0.4), clip_high=math.exp(0.3) - 1)
    assert gmpo[0] == pytest.approx(ppo[0]) and torch.allclose(gmpo[1], ppo[1])


def test_gmpo_rejects_a_dual_clip():
    with pytest.raises(ValueError, match="unset dual_clip"):
        gmpo_loss(t([[0.0]]), t([[0.0]]), t([[1.0]]), t([[1.0]]), dual_clip=3.0)


@pytest.mark.parametrize("loss", [gspo_loss, gspo_token_loss, gmpo_loss, luspo_loss, vespo_loss])
def test_an_empty_response_adds_no_loss_and_no_nan(loss):
    logprobs = t([[0.1, 0.2], [5.0, 5.0]]).requires_grad_(True)
    mask = t([[1, 1], [0, 0]])
    options = {} if loss is vespo_loss else {"clip_low": 0.2, "clip_high": 0.2}
    output = loss(logprobs, torch.zeros(2, 2), t([[1.0, 1.0], [1.0, 1.0]]), mask, **options)
    output.loss.backward()
    assert math.isfinite(output.loss.item()) and torch.all(logprobs.grad[1] == 0)
    assert all(math.isfinite(value.item()) for value in output.metrics.values())
