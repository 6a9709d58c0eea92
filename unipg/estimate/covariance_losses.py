"""Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
Models", arXiv:2505.22617): keep the policy's entropy from collapsing by restraining the few tokens that drive it.

The paper shows that the entropy of a softmax policy falls, step by step, by about the covariance between a
token's log-probability and its advantage: confident tokens with high advantage sharpen the policy. Both losses
score each valid token by its centred product

    cov_t = (A_t − mean(A)) · (log π_θ(a_t) − mean(log π_θ))        (means over the valid tokens of the call)

and restrain a small share r of them (the paper: r = 2e-4 to 2e-3 of the batch's tokens):

- Clip-Cov drops the gradient of r·N tokens drawn at random among those with cov_t in (lb, ub), on top of PPO-clip;
- KL-Cov adds β |log ρ_t| to the r·N tokens of largest cov_t, on top of the unclipped surrogate −ρ A.

The covariance is taken over the tokens the call sees: with micro-batches (``train.micro_batch_size``) that is each
micro-batch, as in verl. Shapes as in ``unipg.estimate.losses``.
"""

from __future__ import annotations

import torch

from unipg.estimate.losses import (
    _CLIP_OPTIONS,
    _PG_INPUTS,
    POLICY_LOSSES,
    LossOutput,
    _apply_weights,
    _check_clip,
    _clipped_surrogate,
    _ratio_metrics,
    aggregate,
)
from unipg.estimate.masked import masked_mean

_RATIO_INPUTS = (*_PG_INPUTS, "behaviour_logprobs")


def token_covariance(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """cov_t = (A_t − mean A) · (log π_t − mean log π) over the valid tokens, (B, T), detached; −inf on padding so
    that no selection picks it."""
    logprobs, advantages = logprobs.detach(), advantages.detach()
    centred = (advantages - masked_mean(advantages, mask)) * (logprobs - masked_mean(logprobs, mask))
    return torch.where(mask.bool(), centred, -torch.inf)


def _selected_count(share: float, mask: torch.Tensor) -> int:
    """max(1, ⌊share · N⌋) with N the valid tokens: the paper always restrains at least one token."""
    return max(int(share * float(mask.sum())), 1)


@POLICY_LOSSES.register(
    "clip_cov",
    inputs=_RATIO_INPUTS,
    options={**_CLIP_OPTIONS, "clip_cov_ratio": "share", "clip_cov_lb": "lower", "clip_cov_ub": "upper"},
)
def clip_cov_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    share: float = 2e-4,
    lower: float = 1.0,
    upper: float = 5.0,
    agg_mode: str = "token-mean",
    weights: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> LossOutput:
    """Clip-Cov (Cui et al. 2025): PPO-clip that also drops the gradient of a few high-covariance tokens.

    The loss of ⌊r·N⌋ tokens (at least one), drawn uniformly among those with ``lower`` < cov_t < ``upper`` that
    PPO did not clip already, is set to 0 (their gradient is dropped):

        loss_t = −min(ρ_t A_t, clip(ρ_t, 1 − ε_low, 1 + ε_high) A_t) · c_t · w_t,   c_t = 0 on the drawn tokens, else 1.

    The draw uses ``generator`` (None: torch's global generator, seeded with the run). Metrics: PPO's, and
    cov_clip_fraction (share of valid tokens dropped by the covariance rule).
    """
    clip_high = clip_low if clip_high is None else clip_high
    _check_clip(clip_low, clip_high, dual_clip)
    if not 0.0 < share <= 1.0 or lower >= upper:
        raise ValueError(
            f"clip_cov_ratio ({share}) must lie in (0, 1] and clip_cov_lb ({lower}) < clip_cov_ub ({upper})"
        )
    objective, ratio, clipped, dual = _clipped_surrogate(
        logprobs - behaviour_logprobs.detach(), advantages, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip
    )
    covariance = token_covariance(logprobs, advantages, mask)
    candidates = torch.nonzero(((covariance > lower) & (covariance < upper) & ~clipped).flatten()).squeeze(-1)
    draw = torch.randperm(len(candidates), generator=generator)[: _selected_count(share, mask)]
    keep = torch.ones_like(objective).flatten()
    keep[candidates[draw.to(candidates.device)]] = 0.0
    keep = keep.view_as(objective)  # (B, T) c_t
    metrics = _ratio_metrics(ratio, clipped, dual, mask, dual_clip is not None)
    metrics["cov_clip_fraction"] = masked_mean(1.0 - keep, mask)
    per_token = _apply_weights(-objective * keep, weights)
    return LossOutput(loss=aggregate(per_token, mask, mode=agg_mode), metrics=metrics)


@POLICY_LOSSES.register(
    "kl_cov",
    inputs=_RATIO_INPUTS,
    options={"kl_cov_ratio": "share", "kl_cov_coef": "coef", "loss_agg_mode": "agg_mode"},
)
def kl_cov_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    share: float = 2e-3,
    coef: float = 1.0,
    agg_mode: str = "token-mean",
    weights: torch.Tensor | None = None,
) -> LossOutput:
    """KL-Cov (Cui et al. 2025): the unclipped surrogate plus β |log ρ| on the highest-covariance tokens.

    The penalty falls on the ⌊r·N⌋ tokens (at least one) of largest covariance:

        loss_t = (−ρ_t A_t + β |log ρ_t| · 1[t among the top-r cov]) · w_t.

    No token is clipped; the penalty pulls only the tokens that drive entropy down back towards μ.
    Metrics: approx_kl, ratio_mean, ratio_max, kl_cov_fraction (share of valid tokens penalised).
    """
    if not 0.0 < share <= 1.0 or coef < 0:
        raise ValueError(f"kl_cov_ratio ({share}) must lie in (0, 1] and kl_cov_coef ({coef}) must be ≥ 0")
    advantages = advantages.detach()
    log_ratio = logprobs - behaviour_logprobs.detach()  # (B, T) log ρ
    ratio = torch.exp(log_ratio)
    covariance = token_covariance(logprobs, advantages, mask).flatten()
    count = min(_selected_count(share, mask), int(mask.bool().sum()))
    penalised = torch.zeros_like(covariance)
    penalised[torch.topk(covariance, count).indices] = 1.0
    penalised = penalised.view_as(log_ratio)  # (B, T)
    per_token = -ratio * advantages + coef * log_ratio.abs() * penalised
    no_clip = torch.zeros_like(mask, dtype=torch.bool)
    metrics = _ratio_metrics(ratio, no_clip, no_clip, mask, False)
    del metrics["clip_fraction"]
    metrics["kl_cov_fraction"] = masked_mean(penalised, mask)
    return LossOutput(loss=aggregate(_apply_weights(per_token, weights), mask, mode=agg_mode), metrics=metrics)
