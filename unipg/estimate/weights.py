"""Off-policy weights w(ρ, age) for the unified objective J(θ) = E_μ[ρ · A · w(ρ, age)].

Every sample carries its behaviour policy μ (the behaviour log-probs recorded at generation time) and
an ``age``: the current policy version minus the version that generated it, per token (B, T) or per
sequence (B,). A weight function turns these into a DETACHED multiplier of the per-token policy loss:
it never carries gradient, it only says how much a token should count.

Every entry of ``OFF_POLICY_WEIGHTS`` has the signature

    fn(logprobs, behaviour_logprobs, mask, *, age=None, **hyperparameters) -> OffPolicyWeights

with ``logprobs`` (B, T) log π_θ(a_t|s_t), ``behaviour_logprobs`` (B, T) log μ(a_t|s_t) and ``mask``
(B, T) 1 on valid tokens. Weights are 0 on padding and on dropped tokens. Weights from several
functions compose by multiplication with ``combine_weights`` (e.g. age decay × KL filter).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from unipg.registry import Registry

from .masked import masked_mean


@dataclass
class OffPolicyWeights:
    """Detached per-token weights and the statistics a user watches to see how off-policy a batch is."""

    weights: torch.Tensor  # (B, T) detached w ≥ 0; 0 on padded and dropped tokens
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # scalar tensors: ess, fraction_dropped, ...
    name: str = "weights"  # which weight function produced it; the metric prefix in combine_weights


OFF_POLICY_WEIGHTS: Registry = Registry("off-policy weight")
# What every off-policy weight reads: current and behaviour log-probs, the mask and each sample's age.
_WEIGHT_INPUTS = ("logprobs", "behaviour_logprobs", "mask", "age")


def weight_metrics(weights: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Statistics of ``weights`` (B, T) over the valid tokens of ``mask`` (B, T).

    ess = (Σ w)² / (n · Σ w²), the normalised effective sample size (Kish 1965): 1 when all n valid
    tokens weigh the same, → 1/n when one token carries all the weight, 0 when every token is dropped.
    """
    valid = mask.bool()
    valid_weights = weights[valid]  # (n,)
    n = valid_weights.numel()
    zero = weights.new_zeros(())
    if n == 0:
        return {"ess": zero, "fraction_dropped": zero, "fraction_downweighted": zero, "weight_mean": zero}
    sum_sq = (valid_weights**2).sum()
    ess = valid_weights.sum() ** 2 / (n * sum_sq) if sum_sq > 0 else zero
    return {
        "ess": ess,
        "fraction_dropped": (valid_weights == 0).to(weights.dtype).mean(),
        "fraction_downweighted": ((valid_weights > 0) & (valid_weights < 1)).to(weights.dtype).mean(),
        "weight_mean": valid_weights.mean(),
    }


def combine_weights(*outputs: OffPolicyWeights, mask: torch.Tensor) -> OffPolicyWeights:
    """w = Π_i w_i: compose weight functions, e.g. ``combine_weights(age_decay, kl_filter, mask=mask)``.

    The combined weights get fresh ``ess`` / ``fraction_*`` / ``weight_mean`` metrics; each input's own
    metrics are kept under its name ("age_decay/ess", "kl_filter/kl_mean", ...).
    """
    if not outputs:
        raise ValueError("combine_weights needs at least one OffPolicyWeights to combine")
    weights = torch.ones_like(outputs[0].weights)
    metrics: dict[str, torch.Tensor] = {}
    for index, output in enumerate(outputs):
        if output.weights.shape != weights.shape:
            raise ValueError(
                f"cannot combine weights of shape {tuple(output.weights.shape)} with {tuple(weights.shape)}; "
                "compute every weight function on the same (B, T) batch"
            )
        weights = weights * output.weights
        repeated = any(earlier.name == output.name for earlier in outputs[:index])
        prefix = f"{output.name}{index}" if repeated else output.name  # "age_decay", then "age_decay1", ...
        metrics.update({f"{prefix}/{key}": value for key, value in output.metrics.items()})
    weights = (weights * mask.to(weights.dtype)).detach()
    metrics.update(weight_metrics(weights, mask))
    name = "*".join(output.name for output in outputs)
    return OffPolicyWeights(weights=weights, metrics=metrics, name=name)


def _check_inputs(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor) -> None:
    if logprobs.shape != behaviour_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, behaviour_logprobs {tuple(behaviour_logprobs.shape)} and "
            f"mask {tuple(mask.shape)} must all have the same (B, T) shape"
        )


def _log_ratio(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) detached log ρ = log π − log μ, 0 on padding (whose log-probs may be garbage or −inf)."""
    _check_inputs(logprobs, behaviour_logprobs, mask)
    log_ratio = (logprobs - behaviour_logprobs).detach()
    return torch.where(mask.bool(), log_ratio, torch.zeros_like(log_ratio))


def _finish(weights: torch.Tensor, mask: torch.Tensor, name: str, **extra: torch.Tensor) -> OffPolicyWeights:
    """Zero the padding, detach, attach the standard metrics."""
    weights = (weights * mask.to(weights.dtype)).detach()
    return OffPolicyWeights(weights=weights, metrics={**weight_metrics(weights, mask), **extra}, name=name)


def _token_age(age: torch.Tensor | None, mask: torch.Tensor, weight_name: str, dtype: torch.dtype) -> torch.Tensor:
    """Broadcast ``age`` (B,) or (B, T) to a (B, T) tensor of ``dtype``; check it is given and ≥ 0."""
    if age is None:
        raise ValueError(
            f"off-policy weight '{weight_name}' needs `age` (current policy version − behaviour version, "
            "shape (B,) or (B, T)); pass age=... or pick a weight that does not use it"
        )
    age = torch.as_tensor(age, device=mask.device)
    if age.dim() == 1 and age.shape[0] == mask.shape[0]:
        age = age.unsqueeze(-1)
    if age.dim() != 2 or age.shape[0] != mask.shape[0] or age.shape[1] not in (1, mask.shape[1]):
        raise ValueError(f"age has shape {tuple(age.shape)}; expected ({mask.shape[0]},) or {tuple(mask.shape)}")
    age = age.expand(mask.shape).to(dtype)
    if (age[mask.bool()] < 0).any():
        raise ValueError("age must be ≥ 0 (current version − behaviour version); got a negative age")
    return age


@OFF_POLICY_WEIGHTS.register("none", inputs=_WEIGHT_INPUTS)
def no_weights(
    logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, *, age: torch.Tensor | None = None
) -> OffPolicyWeights:
    """w = 1 on every valid token: the plain (on-policy or PPO-clipped) objective."""
    _check_inputs(logprobs, behaviour_logprobs, mask)
    return _finish(torch.ones_like(logprobs), mask, "none")


@OFF_POLICY_WEIGHTS.register("truncated_is", inputs=_WEIGHT_INPUTS, options={"is_truncation": "truncation"})
def truncated_importance_weights(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    age: torch.Tensor | None = None,
    truncation: float = 2.0,
    level: str = "token",
) -> OffPolicyWeights:
    """Truncated importance sampling: w = min(ρ, c), ρ = π_θ / μ (Espeholt et al. 2018, IMPALA V-trace ρ̄).

    level="token":    ρ_t = exp(log π(a_t|s_t) − log μ(a_t|s_t)), one weight per token.
    level="sequence": ρ = exp(Σ_t m_t (log π − log μ)), the whole-sequence ratio on every valid token.
    Used with the plain policy-gradient loss, or to correct an inference/training log-prob mismatch.
    Computed as exp(min(log ρ, log c)) so a huge ratio cannot overflow.
    """
    if truncation <= 0:
        raise ValueError(f"truncation c ({truncation}) must be > 0; IMPALA uses c = 1, the default is 2")
    if level not in ("token", "sequence"):
        raise ValueError(f"level '{level}' is not valid; use 'token' or 'sequence'")
    log_ratio = _log_ratio(logprobs, behaviour_logprobs, mask)  # (B, T)
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)  # (B, T), same per row
    log_truncation = torch.log(log_ratio.new_tensor(float(truncation)))
    weights = torch.exp(torch.minimum(log_ratio, log_truncation))
    clipped = (log_ratio > log_truncation) & mask.bool()
    fraction_truncated = clipped.to(weights.dtype).sum() / mask.to(weights.dtype).sum().clamp(min=1.0)
    return _finish(weights, mask, "truncated_is", fraction_truncated=fraction_truncated)


@OFF_POLICY_WEIGHTS.register("age_decay", inputs=_WEIGHT_INPUTS, options={"sample_age_decay": "decay"})
def age_decay_weights(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    age: torch.Tensor | None = None,
    decay: float = 0.99,
) -> OffPolicyWeights:
    """w = γ_age^age: older samples count less (seed 000 §5.2, ``sample_age_decay``).

    With γ_age = 0.99 a sample 100 versions old weighs 0.99¹⁰⁰ ≈ 0.37.
    """
    if not 0 < decay <= 1:
        raise ValueError(f"age decay γ_age ({decay}) must be in (0, 1]; 1 disables the decay, 0.99 is typical")
    _check_inputs(logprobs, behaviour_logprobs, mask)
    token_age = _token_age(age, mask, "age_decay", logprobs.dtype)  # (B, T)
    weights = torch.pow(token_age.new_tensor(float(decay)), token_age)
    return _finish(weights, mask, "age_decay", age_mean=masked_mean(token_age, mask))


@OFF_POLICY_WEIGHTS.register(
    "kl_filter", inputs=_WEIGHT_INPUTS, options={"kl_filter_threshold": "max_kl", "kl_filter_mode": "mode"}
)
def kl_filter_weights(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    age: torch.Tensor | None = None,
    max_kl: float = 0.1,
    mode: str = "drop",
) -> OffPolicyWeights:
    """Drop or down-weight sequences whose behaviour policy has drifted too far from π_θ.

    Per sequence, KL(μ‖π) = E_μ[log μ − log π] is estimated on the sampled tokens with the non-negative
    k3 estimator (Schulman 2020, "Approximating KL divergence"), r_t = π(a_t|s_t) / μ(a_t|s_t):
        KL̂_b = mean_{t valid} [(r_t − 1) − log r_t]        (unbiased since E_μ[r] = 1)
    mode="drop":       w_b = 0 if KL̂_b > max_kl else 1
    mode="downweight": w_b = min(1, max_kl / KL̂_b)
    """
    if max_kl <= 0:
        raise ValueError(f"max_kl ({max_kl}) must be > 0; it is the largest sequence KL(μ‖π) kept at full weight")
    if mode not in ("drop", "downweight"):
        raise ValueError(f"mode '{mode}' is not valid; use 'drop' or 'downweight'")
    log_ratio = _log_ratio(logprobs, behaviour_logprobs, mask)  # (B, T), 0 on padding → k3 = 0 there
    k3 = torch.expm1(log_ratio) - log_ratio  # (B, T) (r − 1) − log r ≥ 0
    sequence_kl = masked_mean(k3, mask, dim=-1)  # (B,)
    too_far = sequence_kl > max_kl  # (B,)
    if mode == "drop":
        sequence_weights = (~too_far).to(k3.dtype)
    else:
        sequence_weights = max_kl / sequence_kl.clamp(min=max_kl)  # min(1, max_kl / KL̂)
    weights = sequence_weights.unsqueeze(-1).expand_as(k3)  # (B, T)
    has_tokens = mask.bool().any(dim=-1)  # (B,) sequences that take part in the batch
    kl_mean = sequence_kl[has_tokens].mean() if has_tokens.any() else k3.new_zeros(())
    return _finish(weights, mask, "kl_filter", kl_mean=kl_mean)


@OFF_POLICY_WEIGHTS.register("version_window", inputs=_WEIGHT_INPUTS, options={"version_window": "window"})
def version_window_weights(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    age: torch.Tensor | None = None,
    window: int | None = None,
) -> OffPolicyWeights:
    """w = 1 if age ≤ window else 0: keep only samples from the ``window`` most recent policy versions.

    window = 0 keeps only on-policy samples (age 0).
    """
    if window is None:
        raise ValueError("off-policy weight 'version_window' needs `window` (the largest age kept, an int ≥ 0)")
    if window < 0:
        raise ValueError(f"window ({window}) must be ≥ 0; 0 keeps only samples of the current policy version")
    _check_inputs(logprobs, behaviour_logprobs, mask)
    token_age = _token_age(age, mask, "version_window", logprobs.dtype)  # (B, T)
    weights = (token_age <= window).to(token_age.dtype)
    return _finish(weights, mask, "version_window")


def engine_mismatch_weights(
    trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor, *, cap: float = 2.0
) -> OffPolicyWeights:
    """Truncated importance weights for the gap between the inference engine and the trainer (TIS; Yao et al.
    2025, "Your efficient RL framework secretly brings you off-policy RL training"):

        r_t = π_trainer(a_t|s_t) / μ_engine(a_t|s_t),     w_t = min(r_t, cap)

    ``trainer_logprobs`` (B, T) are the trainer's log-probs of the sampled tokens under the weights that sampled
    them, before any gradient step; ``engine_logprobs`` (B, T) the log-probs the engine reported when it sampled
    them (different kernels and precision give different numbers for the same weights); ``mask`` (B, T) 1 on the
    tokens to weigh. Detached, 0 off the mask. Metrics over the masked tokens: ``k3``, Schulman's estimator of
    KL(μ_engine‖π_trainer), mean (r − 1) − log r ≥ 0; ``max_ratio``, the largest r (0 with no token);
    ``fraction_capped``, the share of tokens with r > cap.

    >>> out = engine_mismatch_weights(torch.tensor([[0.0, -1.0]]), torch.tensor([[-1.0, -1.0]]),
    ...                               torch.ones(1, 2), cap=2.0)
    >>> [round(w, 4) for w in out.weights[0].tolist()], round(float(out.metrics["max_ratio"]), 4)
    ([2.0, 1.0], 2.7183)
    """
    if cap <= 0:
        raise ValueError(f"cap ({cap}) must be > 0; 2 is typical, and 1 never weighs a token up")
    log_ratio = _log_ratio(trainer_logprobs, engine_logprobs, mask)  # (B, T), 0 off the mask
    log_cap = torch.log(log_ratio.new_tensor(float(cap)))
    weights = torch.exp(torch.minimum(log_ratio, log_cap))
    valid = mask.bool()
    k3 = torch.expm1(log_ratio) - log_ratio  # (B, T) (r − 1) − log r, 0 off the mask
    ratio = torch.where(valid, log_ratio.exp(), torch.zeros_like(log_ratio))
    capped = (log_ratio > log_cap) & valid
    count = mask.to(log_ratio.dtype).sum().clamp(min=1.0)
    return _finish(
        weights,
        mask,
        "engine_mismatch",
        k3=masked_mean(k3, mask),
        max_ratio=ratio.max(),
        fraction_capped=capped.to(log_ratio.dtype).sum() / count,
    )
