"""Token-level policy losses that shape the importance weight differently from PPO's hard clip: CISPO and SAPO.

PPO-clip zeroes the gradient of a token whose ratio ρ = π_θ/μ left the trust region on the side its advantage
pushes towards. These keep such tokens in the update and bound their weight instead:

- CISPO clips the importance weight itself and stops its gradient: every token keeps a REINFORCE gradient
  A ∇log π_θ, scaled by sg(clip(ρ)).
- SAPO replaces the clip by a smooth gate f(ρ) whose slope is 1 at ρ = 1 and decays away from it, with a sharper
  decay for negative advantages.

Shapes as in ``unipg.estimate.losses``: every tensor (B, T), ``mask`` 1 on the policy's sampled tokens.
"""

from __future__ import annotations

import math

import torch

from unipg.estimate.losses import _PG_INPUTS, POLICY_LOSSES, LossOutput, _apply_weights, _ratio_metrics, aggregate

_RATIO_INPUTS = (*_PG_INPUTS, "behaviour_logprobs")
# A log-ratio beyond ±20 (ρ ≈ 5e8) leaves both weights flat; the bound keeps exp() from reaching inf, whose
# product with a zero slope would be NaN in SAPO's gradient.
_LOG_RATIO_BOUND = 20.0


@POLICY_LOSSES.register(
    "cispo",
    inputs=_RATIO_INPUTS,
    options={"weight_clip_low": "clip_low", "weight_clip_high": "clip_high", "loss_agg_mode": "agg_mode"},
)
def cispo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float | None = None,
    clip_high: float | None = 0.2,
    agg_mode: str = "token-mean",
    weights: torch.Tensor | None = None,
) -> LossOutput:
    """CISPO (MiniMax-M1, arXiv:2506.13585): REINFORCE weighted by the clipped, gradient-stopped importance weight.

    Clipped importance-sampling-weight policy optimization:

        loss_t = −sg(clip(ρ_t, 1 − ε_low, 1 + ε_high)) · A_t · log π_θ(a_t|s_t) · w_t.

    A REINFORCE loss weighted by the truncated importance weight: unlike PPO no token's gradient is dropped (the
    rare "fork" tokens that PPO clips after the first update keep contributing); the clip only bounds their weight.
    ``clip_low`` / ``clip_high`` None leave that side unbounded; the paper sets no lower bound and tunes ε_high
    only. With both None this is ``policy_gradient_loss`` weighted by sg(ρ): REINFORCE with importance weights.
    The paper reduces by the batch's token count ("token-mean"). Metrics: clip_fraction (tokens whose weight
    was bounded), approx_kl, ratio_mean, ratio_max.
    """
    if clip_low is not None and not 0.0 <= clip_low <= 1.0:
        raise ValueError(
            f"weight_clip_low ({clip_low}) must lie in [0, 1] (1 − it is the lowest weight); None: no bound"
        )
    if clip_high is not None and clip_high < 0.0:
        raise ValueError(f"weight_clip_high ({clip_high}) must be non-negative; None: no upper bound")
    log_ratio = (logprobs.detach() - behaviour_logprobs).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)  # (B, T) ρ, constant
    lowest = 0.0 if clip_low is None else 1.0 - clip_low
    highest = math.inf if clip_high is None else 1.0 + clip_high
    clipped_ratio = ratio.clamp(lowest, highest)  # (B, T) sg(clip(ρ))
    per_token = -clipped_ratio * advantages.detach() * logprobs
    clipped = clipped_ratio != ratio
    metrics = _ratio_metrics(ratio, clipped, clipped, mask, False)
    return LossOutput(loss=aggregate(_apply_weights(per_token, weights), mask, mode=agg_mode), metrics=metrics)


def sapo_gate(ratio: torch.Tensor, tau: torch.Tensor | float) -> torch.Tensor:
    """SAPO's soft gate f(ρ; τ) = σ(τ (ρ − 1)) · 4/τ (Gao et al. 2025, arXiv:2511.20347).

    Its slope f'(ρ) = 4 σ(1 − σ) = sech²(τ (ρ − 1) / 2) is 1 at ρ = 1 (the unclipped surrogate's) and decays
    smoothly as ρ leaves 1, faster for larger τ; as τ → 0 the slope is 1 everywhere (no trust region at all).
    """
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


@POLICY_LOSSES.register(
    "sapo",
    inputs=_RATIO_INPUTS,
    options={"sapo_tau_pos": "tau_pos", "sapo_tau_neg": "tau_neg", "loss_agg_mode": "agg_mode"},
)
def sapo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    agg_mode: str = "seq-mean-token-mean",
    weights: torch.Tensor | None = None,
) -> LossOutput:
    """SAPO (Gao et al. 2025, arXiv:2511.20347): a smooth sigmoid gate on the token ratio instead of the hard clip.

    Soft adaptive policy optimization:

        loss_t = −f(ρ_t; τ_t) · A_t · w_t,    f(ρ; τ) = σ(τ (ρ − 1)) · 4/τ,    τ_t = τ_pos if A_t > 0 else τ_neg.

    The gradient is −A_t · ρ_t sech²(τ_t (ρ_t − 1) / 2) · ∇log π_θ: PPO's unclipped gradient at ρ = 1, shrinking
    smoothly (never to exactly zero) as the token drifts off-policy, instead of PPO's on/off step. τ_neg > τ_pos
    (the paper: 1.05 and 1.0) damps negative-advantage tokens sooner, since pushing down one token spreads
    probability over the whole vocabulary. The paper reduces by sequence ("seq-mean-token-mean").
    Metrics: approx_kl, ratio_mean, ratio_max, gate_slope_mean (mean f'(ρ) over tokens; 1 = on-policy).
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"sapo_tau_pos ({tau_pos}) and sapo_tau_neg ({tau_neg}) must be > 0 (the paper: 1.0, 1.05)")
    advantages = advantages.detach()
    log_ratio = (logprobs - behaviour_logprobs.detach()).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)  # (B, T) ρ
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(ratio.dtype)  # (B, T) τ_t
    per_token = -sapo_gate(ratio, tau) * advantages
    metrics = _ratio_metrics(ratio, torch.zeros_like(mask, dtype=torch.bool), None, mask, False)
    del metrics["clip_fraction"]  # no token is clipped
    gate = torch.sigmoid(tau * (ratio.detach() - 1.0))
    metrics["gate_slope_mean"] = aggregate(4.0 * gate * (1.0 - gate), mask, mode="token-mean")
    return LossOutput(loss=aggregate(_apply_weights(per_token, weights), mask, mode=agg_mode), metrics=metrics)
