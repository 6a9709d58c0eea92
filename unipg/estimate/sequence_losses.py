"""Policy losses whose importance ratio is taken per sequence: GSPO, GSPO-token, GMPO, LUSPO and VESPO.

Each is the unified objective J = E_μ[ρ · A · w] with ρ the length-normalised ratio of a whole response,

    s_i(θ) = (π_θ(y_i|x) / μ(y_i|x))^{1/|y_i|} = exp( 1/|y_i| Σ_t log(π_θ(y_i,t|·) / μ(y_i,t|·)) ),

where the sum and |y_i| run over the tokens of ``mask`` (the policy's own tokens; tool output and padding are
left out). A row of the (B, T) tensors is one response (one episode for multi-turn agents). The per-sequence
loss is written on each of its tokens and reduced with ``aggregate``; the papers' own reduction is
"seq-mean-token-mean" (every response weighs the same), which is what their presets set. The sequence advantage
is the mean of the token advantages over the response; for the group estimators (one score per response) it is
that score's advantage. VESPO alone takes the plain product of the token ratios (no length normalisation).
"""

from __future__ import annotations

import torch

from unipg.estimate.gated_losses import _LOG_RATIO_BOUND
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
from unipg.estimate.masked import masked_mean, masked_sum

_RATIO_INPUTS = (*_PG_INPUTS, "behaviour_logprobs")


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log s_i = 1/|y_i| Σ_t m_t log ρ_t: the mean token log-ratio of each response, (B, T) → (B,); 0 (s = 1) for
    a response without valid tokens."""
    return masked_mean(log_ratio, mask, dim=-1)


def _sequence_metrics(
    log_ratio: torch.Tensor, sequence_ratio: torch.Tensor, clipped: torch.Tensor, dual: torch.Tensor, mask, dual_on
) -> dict[str, torch.Tensor]:
    """clip_fraction, ratio_mean, ratio_max (and dual_clip_fraction) over the responses with a valid token, from
    ``sequence_ratio``, ``clipped``, ``dual`` (B, 1); approx_kl is the token-level k3 of KL(μ‖π), as for PPO."""
    has_tokens = (mask.to(log_ratio.dtype).sum(-1, keepdim=True) > 0).to(log_ratio.dtype)  # (B, 1)
    metrics = _ratio_metrics(sequence_ratio, clipped, dual, has_tokens, dual_on)
    token_log_ratio = log_ratio.detach()
    metrics["approx_kl"] = masked_mean(torch.expm1(token_log_ratio) - token_log_ratio, mask)
    return metrics


@POLICY_LOSSES.register("gspo", inputs=_RATIO_INPUTS, options=_CLIP_OPTIONS)
def gspo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float | None = 4e-4,
    dual_clip: float | None = None,
    agg_mode: str = "seq-mean-token-mean",
    weights: torch.Tensor | None = None,
) -> LossOutput:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): PPO-clip on the length-normalised sequence ratio s_i.

    Group sequence policy optimization:

        loss_i = −min(s_i A_i, clip(s_i, 1 − ε_low, 1 + ε_high) A_i),    written on every token of response i (· w_t),

    with A_i the mean token advantage of the response. Its gradient is s_i A_i · 1/|y_i| Σ_t ∇log π_θ(y_i,t)
    where unclipped: every token of a response is weighed alike, so one unlikely token cannot dominate the update.
    The clip bounds a length-normalised ratio, so they are two to three orders narrower than PPO's (the paper:
    ε_low 3e-4, ε_high 4e-4). With one-token responses this is ``ppo_clip_loss``. ``dual_clip`` as there.
    Metrics: clip_fraction, ratio_mean, ratio_max over responses; approx_kl (token k3 of KL(μ‖π)).
    """
    clip_high = clip_low if clip_high is None else clip_high
    _check_clip(clip_low, clip_high, dual_clip)
    log_ratio = logprobs - behaviour_logprobs.detach()  # (B, T) log ρ_t
    sequence_advantage = masked_mean(advantages.detach(), mask, dim=-1)  # (B,) A_i
    objective, ratio, clipped, dual = _clipped_surrogate(
        sequence_log_ratio(log_ratio, mask)[:, None],
        sequence_advantage[:, None],
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
    )  # (B, 1) each
    per_token = _apply_weights(-objective.expand_as(logprobs), weights)
    metrics = _sequence_metrics(log_ratio, ratio, clipped, dual, mask, dual_clip is not None)
    return LossOutput(loss=aggregate(per_token, mask, mode=agg_mode), metrics=metrics)


@POLICY_LOSSES.register("gspo_token", inputs=_RATIO_INPUTS, options=_CLIP_OPTIONS)
def gspo_token_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float | None = 4e-4,
    dual_clip: float | None = None,
    agg_mode: str = "seq-mean-token-mean",
    weights: torch.Tensor | None = None,
) -> LossOutput:
    """GSPO-token (Zheng et al. 2025, arXiv:2507.18071): GSPO's sequence ratio with a per-token advantage A_i,t.

    Through the token ratio (the paper's section 4.3):

        s_i,t = sg[s_i] · π_θ(y_i,t|·) / sg[π_θ(y_i,t|·)],
        loss_t = −min(s_i,t A_i,t, clip(s_i,t, 1 − ε_low, 1 + ε_high) A_i,t).

    s_i,t equals s_i in value; its gradient is s_i ∇log π_θ(y_i,t), so with seq-mean-token-mean the update is
    s_i · 1/|y_i| Σ_t A_i,t ∇log π_θ(y_i,t): GSPO's when A_i,t = A_i for every t. Use it with
    advantages that vary along a response (turn-level, process rewards). Metrics as ``gspo_loss``.
    """
    clip_high = clip_low if clip_high is None else clip_high
    _check_clip(clip_low, clip_high, dual_clip)
    log_ratio = logprobs - behaviour_logprobs.detach()  # (B, T) log ρ_t
    sequence = sequence_log_ratio(log_ratio.detach(), mask)  # (B,) sg[log s_i]
    token_log_ratio = logprobs - logprobs.detach() + sequence[:, None]  # (B, T) value log s_i, gradient ∇log π_t
    objective, _, clipped, dual = _clipped_surrogate(
        token_log_ratio, advantages, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip
    )
    per_token = _apply_weights(-objective, weights)
    metrics = _sequence_metrics(log_ratio, sequence.exp()[:, None], clipped.any(-1, keepdim=True), dual, mask, False)
    metrics["clip_fraction"] = masked_mean(clipped.to(log_ratio.dtype), mask)  # clipping is per token here
    if dual_clip is not None:
        metrics["dual_clip_fraction"] = masked_mean(dual.to(log_ratio.dtype), mask)
    return LossOutput(loss=aggregate(per_token, mask, mode=agg_mode), metrics=metrics)


@POLICY_LOSSES.register("gmpo", inputs=_RATIO_INPUTS, options=_CLIP_OPTIONS)
def gmpo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.4,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    agg_mode: str = "seq-mean-token-mean",
    weights: torch.Tensor | None = None,
) -> LossOutput:
    """GMPO (Zhao et al. 2025, arXiv:2507.20673): the geometric mean of a response's token-clipped PPO terms.

    Geometric-mean policy optimization takes the geometric instead of the arithmetic mean,

        J_i = sgn(A_i) · (Π_t |min(ρ_t A_i, clip(ρ_t, e^−ε_low, e^ε_high) A_i)|)^{1/|y_i|}
            = A_i · exp(1/|y_i| Σ_t sgn(A_i) · min(sgn(A_i) log ρ_t, sgn(A_i) clip(log ρ_t, −ε_low, ε_high))),

    so the clip acts per token but in log space (the paper: ε = 0.4, i.e. ρ within (e^−0.4, e^0.4)), and one token
    with an extreme ratio moves the geometric mean far less than the arithmetic one. loss_i = −J_i on every token of
    response i (· w_t). ``dual_clip`` is not part of GMPO and must be None. Metrics: clip_fraction (tokens whose log
    ratio was clipped, on the side that stops the gradient), ratio_mean, ratio_max of the clipped sequence ratio
    over responses; approx_kl (token k3).
    """
    clip_high = clip_low if clip_high is None else clip_high
    _check_clip(clip_low, clip_high, dual_clip)
    if dual_clip is not None:
        raise ValueError("gmpo has no dual clip: its geometric mean already bounds a token's weight; unset dual_clip")
    log_ratio = logprobs - behaviour_logprobs.detach()  # (B, T) log ρ_t
    sequence_advantage = masked_mean(advantages.detach(), mask, dim=-1)  # (B,) A_i
    sign = torch.sign(sequence_advantage)[:, None]  # (B, 1)
    clipped_log_ratio = log_ratio.clamp(-clip_low, clip_high)
    kept = sign * torch.minimum(sign * log_ratio, sign * clipped_log_ratio)  # (B, T) the pessimistic side
    sequence_ratio = torch.exp(sequence_log_ratio(kept, mask))  # (B,)
    per_token = _apply_weights(-(sequence_advantage * sequence_ratio)[:, None].expand_as(logprobs), weights)
    clipped = (sign * clipped_log_ratio < sign * log_ratio).to(log_ratio.dtype)  # (B, T) gradient stopped here
    metrics = _sequence_metrics(
        log_ratio, sequence_ratio[:, None], torch.zeros_like(sign, dtype=torch.bool), None, mask, False
    )
    metrics["clip_fraction"] = masked_mean(clipped.detach(), mask)
    return LossOutput(loss=aggregate(per_token, mask, mode=agg_mode), metrics=metrics)


@POLICY_LOSSES.register("luspo", inputs=_RATIO_INPUTS, options=_CLIP_OPTIONS)
def luspo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float | None = 4e-4,
    dual_clip: float | None = None,
    agg_mode: str = "seq-mean-token-mean",
    weights: torch.Tensor | None = None,
) -> LossOutput:
    """LUSPO (Liu et al. 2026, arXiv:2602.05261): GSPO with each response's loss scaled by its length |y_i|.

    Length-unbiased sequence policy optimization:

        loss_i = −|y_i| · min(s_i A_i, clip(s_i, 1 − ε_low, 1 + ε_high) A_i),    written on every token of response i,

    that is ``gspo_loss`` with the weight w_i = |y_i| (times any w_t). Under "seq-mean-token-mean" (the preset) the
    loss is 1/B Σ_i |y_i| J_i (TRL's loss_type "luspo"), the same value as GSPO reduced by "seq-mean-token-sum". GSPO's
    gradient on a token is s_i A_i / |y_i|, so a short response moves each of its tokens more than a long one with
    the same advantage and training drifts towards short answers; here it is s_i A_i whatever the length. Clip and
    metrics as ``gspo_loss``.
    """
    lengths = mask.to(logprobs.dtype).sum(dim=-1, keepdim=True)  # (B, 1) |y_i|
    length_weights = lengths.expand_as(logprobs) if weights is None else lengths * weights
    return gspo_loss(
        logprobs,
        behaviour_logprobs,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        agg_mode=agg_mode,
        weights=length_weights,
    )


def vespo_kernel(sequence_ratio: torch.Tensor, k: torch.Tensor | float, lam: torch.Tensor | float) -> torch.Tensor:
    """VESPO's reshaping kernel φ(W) = W^k · e^{λ (1 − W)} (Shen et al. 2026, arXiv:2602.10693), φ(1) = 1.

    A gamma-shaped weight of the sequence ratio W: 0 at W = 0, largest at W = k/λ, decaying exponentially for large W.
    Computed in log space, log φ = k log W + λ (1 − W).
    """
    return torch.exp(k * torch.log(sequence_ratio) + lam * (1.0 - sequence_ratio))


@POLICY_LOSSES.register(
    "vespo",
    inputs=_RATIO_INPUTS,
    options={
        "vespo_k_pos": "k_pos",
        "vespo_lambda_pos": "lambda_pos",
        "vespo_k_neg": "k_neg",
        "vespo_lambda_neg": "lambda_neg",
        "loss_agg_mode": "agg_mode",
    },
)
def vespo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
    agg_mode: str = "token-mean",
    weights: torch.Tensor | None = None,
) -> LossOutput:
    """VESPO (Shen et al. 2026, arXiv:2602.10693): REINFORCE weighted by a smooth kernel of the whole sequence's ratio.

    Variational sequence-level soft policy optimization:

        loss_t = −sg(φ(W_i)) · A_t · log π_θ(a_t|s_t) · w_t,    W_i = Π_t ρ_t = π_θ(y_i|x) / μ(y_i|x),
        φ(W) = W^k · e^{λ (1 − W)},    (k, λ) = (k_pos, λ_pos) if A_i ≥ 0 else (k_neg, λ_neg),

    with A_i the response's mean token advantage. W_i is the true sequence ratio, not GSPO's length-normalised one,
    and no token's gradient is dropped: the kernel (``vespo_kernel``) scales the whole response's REINFORCE gradient
    down smoothly as it drifts off-policy. Defaults are TRL's and the authors' code's (k 2 / λ 3 for A ≥ 0, k 3 / λ 2
    for A < 0); their reduction is "token-mean". On-policy (W = 1, φ = 1) this is ``policy_gradient_loss``. Token log
    ratios and log W are bounded to ±20 so that exp() stays finite. Metrics: approx_kl (token k3), ratio_mean and
    ratio_max of W over responses, kernel_mean (mean φ over responses).
    """
    if min(k_pos, k_neg) < 0 or min(lambda_pos, lambda_neg) < 0:
        raise ValueError(
            f"vespo_k_pos ({k_pos}), vespo_k_neg ({k_neg}), vespo_lambda_pos ({lambda_pos}) and vespo_lambda_neg "
            f"({lambda_neg}) must be ≥ 0 (TRL: 2, 3, 3, 2)"
        )
    token_log_ratio = (logprobs.detach() - behaviour_logprobs).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    log_ratio = masked_sum(token_log_ratio, mask, dim=-1).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)  # (B,) log W_i
    sequence_ratio = torch.exp(log_ratio)
    positive = masked_mean(advantages.detach(), mask, dim=-1) >= 0  # (B,) sign of A_i
    k = torch.where(positive, k_pos, k_neg).to(sequence_ratio.dtype)
    lam = torch.where(positive, lambda_pos, lambda_neg).to(sequence_ratio.dtype)
    kernel = vespo_kernel(sequence_ratio, k, lam)  # (B,) φ(W_i), constant
    per_token = -kernel[:, None] * advantages.detach() * logprobs
    has_tokens = (mask.to(logprobs.dtype).sum(-1) > 0).to(logprobs.dtype)  # (B,)
    metrics = {
        "approx_kl": masked_mean(torch.expm1(token_log_ratio) - token_log_ratio, mask),
        "ratio_mean": masked_mean(sequence_ratio, has_tokens),
        "ratio_max": (sequence_ratio * has_tokens).max(),
        "kernel_mean": masked_mean(kernel, has_tokens),
    }
    return LossOutput(loss=aggregate(_apply_weights(per_token, weights), mask, mode=agg_mode), metrics=metrics)
