"""Policy losses, value loss, entropy and loss aggregation.

Shape convention: batch first, time last; every per-token tensor is (B, T) and ``mask`` (B, T) is 1 on the
tokens the policy sampled, 0 on prompt, tool output and padding (bool or float). The losses named in
``ALL_VALID_LOSSES`` and ``value_loss`` also take ``mask`` None for a batch without padding (environment steps).

All policy losses are instances of the unified objective J(θ) = E_{(s,a)~μ}[ρ · A · w], with
ρ = π_θ(a|s) / μ(a|s): ``advantages`` and ``weights`` are treated as constants (detached), and
``weights`` (B, T) carries any off-policy weight w(ρ, age) into the per-token loss before aggregation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from unipg.estimate.masked import masked_mean, masked_sum, masked_var
from unipg.registry import Registry

POLICY_LOSSES = Registry("policy loss")
# The policy losses that take ``mask`` None (every token valid) and then reduce with plain means.
ALL_VALID_LOSSES = frozenset({"vanilla", "ppo", "decoupled_ppo"})
# What every policy loss reads, and the settings of the clipped ones ({config field: keyword}).
_PG_INPUTS = ("logprobs", "advantages", "mask", "weights")
_CLIP_OPTIONS = {
    "clip_range": "clip_low",
    "clip_range_high": "clip_high",
    "dual_clip": "dual_clip",
    "loss_agg_mode": "agg_mode",
}


def reads_proximal_logprobs(name: str) -> bool:
    """Whether policy loss ``name`` anchors its trust region at a proximal policy π_prox (its declared inputs hold
    ``proximal_logprobs``), which the learner then evaluates before the update's first step."""
    return name in POLICY_LOSSES and "proximal_logprobs" in POLICY_LOSSES.entry(name).inputs


@dataclass
class LossOutput:
    """A scalar loss to minimise and the detached scalar metrics to log beside it."""

    loss: torch.Tensor  # () differentiable
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # name → () detached


# ---------------------------------------------------------------------------------------------------
# Aggregation


def _token_mean(values: torch.Tensor, mask: torch.Tensor, norm_length: int | None) -> torch.Tensor:
    return masked_mean(values, mask)


def _seq_mean(per_sequence: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the sequences that have at least one valid token (an empty one carries no loss)."""
    has_tokens = mask.to(per_sequence.dtype).sum(dim=-1) > 0  # (B,)
    return masked_mean(per_sequence, has_tokens)


def _seq_mean_token_mean(values: torch.Tensor, mask: torch.Tensor, norm_length: int | None) -> torch.Tensor:
    return _seq_mean(masked_mean(values, mask, dim=-1), mask)


def _seq_mean_token_sum(values: torch.Tensor, mask: torch.Tensor, norm_length: int | None) -> torch.Tensor:
    return _seq_mean(masked_sum(values, mask, dim=-1), mask)


def _seq_mean_token_sum_norm(values: torch.Tensor, mask: torch.Tensor, norm_length: int | None) -> torch.Tensor:
    length = values.shape[-1] if norm_length is None else norm_length
    return masked_sum(values, mask) / (values.shape[0] * length)


_AGGREGATIONS = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}
LOSS_AGGREGATIONS: tuple[str, ...] = tuple(_AGGREGATIONS)


def aggregate(
    values: torch.Tensor, mask: torch.Tensor | None, *, mode: str, norm_length: int | None = None
) -> torch.Tensor:
    """Reduce a per-token loss (B, T) to a scalar over the valid tokens (``mask`` None: every token valid).

    - "token-mean": Σ m·x / Σ m over the whole batch; every token weighs the same (Yu et al. 2025, DAPO).
    - "seq-mean-token-mean": mean over sequences of each sequence's token mean; every sequence weighs
      the same, so tokens of long sequences weigh less (Shao et al. 2024, GRPO as published).
    - "seq-mean-token-sum": mean over sequences of each sequence's token sum.
    - "seq-mean-token-sum-norm": Σ m·x / (B · norm_length), a constant normaliser with no length bias
      (Liu et al. 2025, Dr.GRPO); ``norm_length`` defaults to T.

    The two "seq-mean" modes average over sequences with at least one valid token; a batch with no
    valid token gives 0, never NaN.
    """
    if mode not in _AGGREGATIONS:
        valid = ", ".join(LOSS_AGGREGATIONS)
        raise ValueError(f"unknown loss aggregation mode '{mode}'; valid modes: {valid}")
    if mask is None and mode.startswith("seq-mean"):  # they count the sequences that have a valid token
        mask = torch.ones_like(values)
    return _AGGREGATIONS[mode](values, mask, norm_length)


# ---------------------------------------------------------------------------------------------------
# Policy losses


def _apply_weights(per_token: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    return per_token if weights is None else per_token * weights.detach()


@POLICY_LOSSES.register("vanilla", inputs=_PG_INPUTS, options={"loss_agg_mode": "agg_mode"})
def policy_gradient_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    agg_mode: str = "token-mean",
    weights: torch.Tensor | None = None,
) -> LossOutput:
    """On-policy policy gradient (Williams 1992): loss_t = −A_t · log π_θ(a_t|s_t) · w_t.

    ``logprobs`` (B, T) log π_θ(a_t|s_t); ``advantages`` (B, T) are constants. Its gradient is
    −E[A ∇ log π], the REINFORCE estimator; it is the PPO loss at ρ ≡ 1 (μ = π_θ).
    """
    per_token = -advantages.detach() * logprobs  # (B, T)
    return LossOutput(loss=aggregate(_apply_weights(per_token, weights), mask, mode=agg_mode))


def _check_clip(clip_low: float, clip_high: float, dual_clip: float | None) -> None:
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low ({clip_low}) must lie in [0, 1) so that 1 − clip_low stays positive")
    if clip_high < 0.0:
        raise ValueError(f"clip_high ({clip_high}) must be non-negative")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip ({dual_clip}) must be greater than 1 (Ye et al. 2020 use 3)")


def _clipped_surrogate(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The PPO-clip objective per token (Schulman et al. 2017, eq. 7), optionally dual-clipped.

        L = min(ρ A, clip(ρ, 1 − ε_low, 1 + ε_high) A);    with dual clip c > 1 and A < 0: max(L, c A).

    Returns (objective, ratio, clipped, dual_clipped); the last two are bool masks where the
    gradient is zeroed by the PPO clip and by the dual clip respectively.
    """
    advantages = advantages.detach()
    ratio = torch.exp(log_ratio)  # (B, T) ρ
    unclipped = ratio * advantages
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    objective = torch.minimum(unclipped, clipped_ratio * advantages)
    clipped = clipped_ratio * advantages < unclipped
    dual_clipped = torch.zeros_like(clipped)
    if dual_clip is not None:
        # Ye et al. 2020, eq. 5: for A < 0 a huge ρ would make ρA unbounded below; cap it at c·A.
        lower_bound = dual_clip * advantages
        dual_clipped = (advantages < 0) & (lower_bound > objective)
        objective = torch.where(dual_clipped, lower_bound, objective)
    return objective, ratio, clipped, dual_clipped


def ppo_clip_coefficient(
    log_ratio: torch.Tensor, advantages: torch.Tensor, *, clip_low: float, clip_high: float
) -> torch.Tensor:
    """∂/∂ log π_θ of the per-token PPO-clip objective min(ρA, clip(ρ, 1 − ε_low, 1 + ε_high) A) (no dual clip):
    ρ·A where the unclipped term is the minimum, 0 where the clip holds, by ``_clipped_surrogate``'s rule.
    For a learner that writes its gradient by hand (``unipg.learn.mlp_gradient``); constants, no graph."""
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages < unclipped
    return torch.where(clipped, 0.0, unclipped)


def _ratio_metrics(
    ratio: torch.Tensor, clipped: torch.Tensor, dual_clipped: torch.Tensor, mask: torch.Tensor | None, dual: bool
) -> dict[str, torch.Tensor]:
    """clip_fraction, approx_kl, ratio_mean, ratio_max (and dual_clip_fraction) over the valid tokens of ``mask``
    (None: every token valid)."""
    ratio = ratio.detach()
    # Schulman's k3 estimator of KL(μ‖π) from samples of μ: (ρ − 1) − log ρ ≥ 0. The three means are taken in one
    # masked reduction: a PPO step on a small network spends more on each reduction's overhead than on its arithmetic.
    stacked = torch.stack([clipped.to(ratio.dtype), (ratio - 1.0) - torch.log(ratio), ratio])  # (3, B, T)
    stacked_mask = None if mask is None else mask.expand_as(stacked)
    clip_fraction, approx_kl, ratio_mean = masked_mean(stacked, stacked_mask, dim=(1, 2)).unbind()
    valid_ratio = ratio if mask is None else torch.where(mask.bool(), ratio, torch.zeros_like(ratio))
    metrics = {
        "clip_fraction": clip_fraction,
        "approx_kl": approx_kl,
        "ratio_mean": ratio_mean,
        "ratio_max": valid_ratio.max(),  # ρ > 0, so 0 = none valid
    }
    if dual:
        metrics["dual_clip_fraction"] = masked_mean(dual_clipped.to(ratio.dtype), mask)
    return metrics


@POLICY_LOSSES.register("ppo", inputs=(*_PG_INPUTS, "behaviour_logprobs"), options=_CLIP_OPTIONS)
def ppo_clip_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    agg_mode: str = "token-mean",
    weights: torch.Tensor | None = None,
) -> LossOutput:
    """PPO-clip (Schulman et al. 2017, eq. 7):

        loss_t = −min(ρ_t A_t, clip(ρ_t, 1 − ε_low, 1 + ε_high) A_t) · w_t.

    ρ_t = exp(log π_θ − log μ) with ``logprobs`` (B, T) log π_θ(a_t|s_t) and ``behaviour_logprobs``
    (B, T) log μ(a_t|s_t) (constant). ``clip_high`` defaults to ``clip_low``; a larger ε_high is DAPO's
    clip-higher (Yu et al. 2025). ``dual_clip`` c > 1 bounds the loss for A < 0 at −c·A (Ye et al. 2020).
    Metrics: clip_fraction, approx_kl (k3 of KL(μ‖π)), ratio_mean, ratio_max (+ dual_clip_fraction).
    """
    clip_high = clip_low if clip_high is None else clip_high
    _check_clip(clip_low, clip_high, dual_clip)
    objective, ratio, clipped, dual_clipped = _clipped_surrogate(
        logprobs - behaviour_logprobs.detach(),
        advantages,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
    )
    loss = aggregate(_apply_weights(-objective, weights), mask, mode=agg_mode)
    metrics = _ratio_metrics(ratio, clipped, dual_clipped, mask, dual_clip is not None)
    return LossOutput(loss=loss, metrics=metrics)


@POLICY_LOSSES.register(
    "decoupled_ppo",
    inputs=(*_PG_INPUTS, "behaviour_logprobs", "proximal_logprobs"),
    options={**_CLIP_OPTIONS, "behaviour_weight_cap": "behaviour_weight_cap"},
)
def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    agg_mode: str = "token-mean",
    weights: torch.Tensor | None = None,
    behaviour_weight_cap: float | None = None,
) -> LossOutput:
    """Decoupled PPO (Hilton et al. 2022; AReaL, Fu et al. 2025): the behaviour policy μ corrects the
    sampling, the proximal policy π_prox anchors the trust region:

        loss_t = −(π_prox / μ) · min(r_t A_t, clip(r_t, 1 − ε_low, 1 + ε_high) A_t) · w_t,
        r_t = π_θ / π_prox.

    ``proximal_logprobs`` (B, T) log π_prox(a_t|s_t), usually the current weights before this update,
    and ``behaviour_logprobs`` (B, T) log μ(a_t|s_t) are constants. With π_prox = μ this is
    ``ppo_clip_loss``.
    ``behaviour_weight_cap`` c truncates the behaviour weight to min(π_prox / μ, c): with very stale samples
    a few tokens the behaviour policy found unlikely would otherwise carry most of the gradient.
    Metrics as ``ppo_clip_loss`` (for r, i.e. against π_prox) plus behaviour_weight_mean / _max (before the cap)
    and, with a cap, behaviour_weight_capped (the share of tokens truncated).
    """
    clip_high = clip_low if clip_high is None else clip_high
    _check_clip(clip_low, clip_high, dual_clip)
    if behaviour_weight_cap is not None and behaviour_weight_cap <= 0:
        raise ValueError(f"behaviour_weight_cap ({behaviour_weight_cap}) must be > 0; AReaL uses 5, None for no cap")
    behaviour_weight = torch.exp(proximal_logprobs - behaviour_logprobs).detach()  # (B, T) π_prox / μ
    used_weight = behaviour_weight if behaviour_weight_cap is None else behaviour_weight.clamp(max=behaviour_weight_cap)
    objective, ratio, clipped, dual_clipped = _clipped_surrogate(
        logprobs - proximal_logprobs.detach(),
        advantages,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
    )
    per_token = _apply_weights(-objective * used_weight, weights)
    metrics = _ratio_metrics(ratio, clipped, dual_clipped, mask, dual_clip is not None)
    metrics["behaviour_weight_mean"] = masked_mean(behaviour_weight, mask)
    metrics["behaviour_weight_max"] = (
        behaviour_weight if mask is None else torch.where(mask.bool(), behaviour_weight, 0.0)
    ).max()
    if behaviour_weight_cap is not None:
        metrics["behaviour_weight_capped"] = masked_mean((behaviour_weight > behaviour_weight_cap).float(), mask)
    return LossOutput(loss=aggregate(per_token, mask, mode=agg_mode), metrics=metrics)


# ---------------------------------------------------------------------------------------------------
# Value function and entropy


def value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    old_values: torch.Tensor | None = None,
    clip_range: float | None = None,
    agg_mode: str = "token-mean",
) -> LossOutput:
    """Squared error ½ (V − R)², or with ``clip_range`` ε the PPO2 clipped form (baselines ppo2):

        ½ max((V − R)², (V_old + clip(V − V_old, −ε, ε) − R)²).

    ``values`` (B, T) V_φ(s_t); ``returns`` (B, T) targets and ``old_values`` (B, T) V at rollout time
    are constants. Metric "value_clip_fraction" (tokens where the clipped term is the larger) when clipped.
    """
    returns = returns.detach()
    squared_error = (values - returns) ** 2  # (B, T)
    if clip_range is None:
        return LossOutput(loss=aggregate(0.5 * squared_error, mask, mode=agg_mode))
    if old_values is None:
        raise ValueError("value clipping needs old_values (V at rollout time); pass them or set clip_range=None")
    old_values = old_values.detach()
    clipped_values = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    clipped_error = (clipped_values - returns) ** 2
    loss = aggregate(0.5 * torch.maximum(squared_error, clipped_error), mask, mode=agg_mode)
    clip_fraction = masked_mean((clipped_error > squared_error).to(values.dtype), mask).detach()
    return LossOutput(loss=loss, metrics={"value_clip_fraction": clip_fraction})


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 − Var[R − V] / Var[R] over the valid entries: 1 is a perfect critic, 0 no better than a constant,
    negative worse. When the returns have no variance the ratio is undefined and 0 is reported (not NaN).
    """
    return_variance = masked_var(returns, mask)
    if return_variance <= 0:
        return torch.zeros((), dtype=values.dtype, device=values.device)
    return 1.0 - masked_var(returns - values, mask) / return_variance


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy H = −Σ_v p_v log p_v of softmax(logits) over the last dimension; (…, V) → (…).

    Computed from log-softmax (logsumexp), so large logits do not overflow; entries at −inf (a masked
    vocabulary) have p = 0 and contribute 0 to the value and to the gradient, never NaN.
    """
    log_probs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)  # (…, V) log p_v
    probs = torch.exp(log_probs)
    # 0 · (−inf) is NaN: zero the log first so that neither value nor gradient sees it.
    finite_log_probs = torch.where(probs > 0, log_probs, torch.zeros_like(log_probs))
    return -(probs * finite_log_probs).sum(dim=-1)
