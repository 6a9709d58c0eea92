"""The unified objective J(θ) = E_μ[ρ · A · w(ρ, age)], ρ = π_θ/μ, as the one loss every gradient learner minimises.

Both learners only lay their data out as an ``ObjectiveBatch`` and call ``unified_objective``; the math comes
from ``unipg.estimate``, each piece through its registry with the options of the ``estimator`` config section:

    loss = policy_loss(ρ, A, w)                       POLICY_LOSSES[estimator.policy_loss], w from
                                                      OFF_POLICY_WEIGHTS[estimator.off_policy_weight]
         + kl_coef · aggregate(KL(π_θ‖π_ref))        KL_ESTIMATORS[estimator.kl_estimator], if π_ref is given
         + value_loss_coef · ½ (V − R)²              (PPO2-clipped with value_clip_range), if values are given
         − entropy_coef · token-mean H(π_θ)          if entropy_coef > 0

Shapes are token-level (B, T) with ``mask`` 1 on the tokens the policy sampled; a flat batch of M environment
steps is M one-step sequences (M, 1) with every step valid (``ObjectiveBatch.from_steps``).

Where the two learners differ, the caller says so with an explicit argument, so that each keeps its numbers:

- ``kl_coef``: only the language-model learner has a reference policy; it passes 0 when the KL is paid in the
  token rewards instead (``estimator.kl_in_reward``), and ``kl_to_reference`` is reported either way.
- Global denominators: the language-model learner accumulates a mini-batch's gradient over micro-batches and
  weighs each micro-batch's loss and metrics by ``micro_batch_share``, so that the sum uses the mini-batch's
  denominators (its token count, its sequence count, or B · max_new_tokens) whatever the micro-batch size.
  The gymnasium learner steps on whole mini-batches: their own denominators are the global ones.
- ``report_importance_ess``: the effective sample size of ρ·w, reported by the language-model learner when
  its batch carries ages (asynchronous data). Gym samples always carry an age (0 when fresh); the
  gymnasium learner does not ask for it.
- Advantages are prepared by the caller: the gymnasium learner whitens them per mini-batch, the language-model
  learner once per batch when it computes them.
- ``tis_cap``: the language-model learner corrects the gap between its inference engine and itself (below);
  the gymnasium learner samples with the very module it trains, so it has no such gap and passes None.

The terms are summed in the order of the formula.

The engine gap, measured and corrected (truncated importance sampling, TIS). The log-probs μ_engine an inference
engine reports for the tokens it sampled are not the trainer's log-probs π_trainer_old of the same tokens under
the same weights: other kernels, other precision (vLLM, bfloat16). The PPO ratio π_θ/μ_engine would then clip
on noise, and the gradient would be that of a slightly different policy. With ``tis_cap`` set, the objective
takes two policies apart, as decoupled PPO does for staleness:

- for a token sampled at the learner's current version (age 0), π_trainer_old (``proximal_logprobs``: the
  trainer's log-probs before any gradient step of the update) stands in for μ in the policy loss — the PPO ratio
  is π_θ/π_trainer_old, and any off-policy weight reads it too — and the engine gap enters as the detached weight
      w_tis = min(π_trainer_old / μ_engine, tis_cap),
  multiplied into the off-policy weight w (``unipg.estimate.weights.engine_mismatch_weights``);
- a stale token (age > 0) keeps μ_engine: the trainer's log-probs under the weights that sampled it are gone,
  so its engine gap cannot be told apart from its staleness, and the staleness correction handles both (with
  decoupled_ppo the behaviour weight π_prox/μ_engine, capped by ``estimator.behaviour_weight_cap``); w_tis = 1.

When π_trainer_old equals μ_engine the loss is the one without correction. The learner measures the gap once per
update over the age-0 tokens of its batch (``mismatch/k3``, ``mismatch/max_ratio``, ``mismatch/fraction_capped``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from unipg.estimate import KL_ESTIMATORS, OFF_POLICY_WEIGHTS, POLICY_LOSSES
from unipg.estimate.losses import ALL_VALID_LOSSES, aggregate, value_loss
from unipg.estimate.masked import masked_mean, top_fraction_mask
from unipg.estimate.weights import OffPolicyWeights, engine_mismatch_weights, weight_metrics

if TYPE_CHECKING:
    from unipg.config.schema import EstimatorConfig
    from unipg.learn.lm_batch import LMBatch


def as_tokens(x: torch.Tensor) -> torch.Tensor:
    """A flat batch of steps (M,) viewed as M one-step sequences (M, 1) for the (B, T) loss functions."""
    return x.unsqueeze(-1)


@dataclass
class ObjectiveBatch:
    """One (micro-)batch as the objective reads it; every tensor is (B, T) unless said otherwise."""

    logprobs: torch.Tensor  # (B, T) log π_θ(a_t|s_t), differentiable
    behaviour_logprobs: torch.Tensor  # (B, T) log μ(a_t|s_t) recorded when the sample was drawn
    advantages: torch.Tensor  # (B, T) A_t, constants
    mask: torch.Tensor  # (B, T) 1 on the tokens the policy sampled
    proximal_logprobs: torch.Tensor | None = None  # (B, T) log π_prox = π_trainer_old, the trainer's before the
    # update's first step: decoupled_ppo's anchor and, with tis_cap, μ's stand-in on age-0 tokens; None: μ
    age: torch.Tensor | None = None  # (B,) or (B, T) current version − behaviour version; None: 0
    entropy: torch.Tensor | None = None  # (B, T) H(π_θ(·|s_t)); None: no entropy bonus nor metric
    values: torch.Tensor | None = None  # (B, T) V_φ(s_t), differentiable; None: no critic term
    old_values: torch.Tensor | None = None  # (B, T) V(s_t) when the advantages were computed
    returns: torch.Tensor | None = None  # (B, T) value-regression targets
    reference_logprobs: torch.Tensor | None = None  # (B, T) log π_ref(a_t|s_t); None: no KL term
    every_token_valid: bool = False  # ``mask`` is all ones: the policy, value and entropy terms take plain means

    @property
    def reduction_mask(self) -> torch.Tensor | None:
        """The mask the policy, value and entropy terms reduce over; None when every token is valid, for the
        plain means that cost a small batch of environment steps a fraction of the masked ones."""
        return None if self.every_token_valid else self.mask

    @classmethod
    def from_steps(cls, **steps: torch.Tensor | None) -> ObjectiveBatch:
        """M flat environment steps, each (M,), as M one-step sequences (M, 1), every step valid."""
        tokens = {name: None if value is None else as_tokens(value) for name, value in steps.items()}
        return cls(mask=torch.ones_like(tokens["logprobs"]), every_token_valid=True, **tokens)


@dataclass
class ObjectiveOutput:
    """The loss to back-propagate and the metrics of the batch it was computed on."""

    loss: torch.Tensor  # () to minimise, differentiable
    metrics: dict[str, float] = field(default_factory=dict)  # name → value on this batch


def unified_objective(
    batch: ObjectiveBatch,
    settings: EstimatorConfig,
    *,
    kl_coef: float = 0.0,
    report_importance_ess: bool = False,
    tis_cap: float | None = None,
    tensor_metrics: bool = False,
) -> ObjectiveOutput:
    """policy loss + kl_coef·KL + value_loss_coef·value loss − entropy_coef·entropy of ``batch``.

    ``settings`` is the ``estimator`` config section. ``kl_coef`` scales the KL to the reference in the loss
    (0: only report it). ``tis_cap``: correct the engine gap of age-0 tokens (module docstring); None: no
    correction. Metrics: policy_loss and the policy loss's own, approx_kl, kl_to_reference, value_loss, entropy,
    weights_* (off-policy weight statistics), importance_ess (when asked) and loss. With ``tensor_metrics`` the
    metrics are detached 0-d tensors, not floats: a caller that only reports their mean over many steps reads
    them once then, instead of each one after every step.
    """
    batch, engine_weights = engine_correction(batch, tis_cap)
    weights = off_policy_weights(settings, batch.logprobs.detach(), batch.behaviour_logprobs, batch.mask, age=batch.age)
    combined = weights.weights if weights is not None else None
    if engine_weights is not None:
        combined = engine_weights if combined is None else combined * engine_weights
    loss, metrics = policy_term(batch, settings, combined, tensor_metrics=tensor_metrics)
    read = _tensor_metric if tensor_metrics else _float_metric
    if batch.reference_logprobs is not None:
        kl = KL_ESTIMATORS.call(
            settings.kl_estimator, {"logprobs": batch.logprobs, "ref_logprobs": batch.reference_logprobs}
        )
        if kl_coef > 0:
            loss = loss + kl_coef * aggregate(kl, batch.mask, mode=settings.loss_agg_mode)
        metrics["kl_to_reference"] = read(masked_mean(kl.detach(), batch.mask))
    if batch.values is not None:
        critic = value_loss(
            batch.values,
            batch.returns,
            batch.reduction_mask,
            old_values=batch.old_values,
            clip_range=settings.value_clip_range,
        )
        loss = loss + settings.value_loss_coef * critic.loss
        metrics["value_loss"] = read(critic.loss)
    if batch.entropy is not None:
        entropy = aggregate(batch.entropy, batch.reduction_mask, mode="token-mean")
        if settings.entropy_coef > 0:
            loss = loss - settings.entropy_coef * entropy
        metrics["entropy"] = read(entropy)
    if weights is not None:
        metrics.update({f"weights_{k}": read(v) for k, v in weights.metrics.items()})
    if report_importance_ess:
        metrics["importance_ess"] = read(importance_ess(batch, combined))
    metrics["loss"] = read(loss)
    return ObjectiveOutput(loss, metrics)


def _float_metric(value: torch.Tensor | float) -> float:
    return value.item() if isinstance(value, torch.Tensor) else float(value)


def _tensor_metric(value: torch.Tensor | float) -> torch.Tensor:
    """A metric as a detached 0-d tensor (``unified_objective``'s ``tensor_metrics``)."""
    if isinstance(value, torch.Tensor):
        return value.detach() if value.requires_grad else value
    return torch.tensor(float(value))


def policy_term(
    batch: ObjectiveBatch, settings: EstimatorConfig, weights: torch.Tensor | None, *, tensor_metrics: bool = False
) -> tuple[torch.Tensor, dict[str, float]]:
    """The configured policy loss weighted by ``weights`` (B, T) w (None: 1), its metrics, and approx_kl (k3 of
    KL(μ‖π)) where the loss does not report it; metrics as detached tensors with ``tensor_metrics``."""
    proximal = batch.behaviour_logprobs if batch.proximal_logprobs is None else batch.proximal_logprobs
    data = {
        "logprobs": batch.logprobs,
        "behaviour_logprobs": batch.behaviour_logprobs,
        "proximal_logprobs": proximal,
        "advantages": batch.advantages,
        "mask": policy_gradient_tokens(batch, settings.top_entropy_quantile, settings.policy_loss),
        "weights": weights,
    }
    out = POLICY_LOSSES.call(settings.policy_loss, data, settings)
    read = _tensor_metric if tensor_metrics else _float_metric
    metrics = {"policy_loss": read(out.loss), **{k: read(v) for k, v in out.metrics.items()}}
    if "approx_kl" not in metrics:
        with torch.no_grad():
            log_ratio = batch.logprobs.detach() - batch.behaviour_logprobs
            metrics["approx_kl"] = read(masked_mean((log_ratio.exp() - 1) - log_ratio, batch.reduction_mask))
    return out.loss, metrics


def policy_gradient_tokens(
    batch: ObjectiveBatch, top_entropy_quantile: float, policy_loss: str | None = None
) -> torch.Tensor | None:
    """(B, T) the tokens the policy loss reads: every valid one, or with ``top_entropy_quantile`` ρ < 1 the share ρ
    of highest entropy among the valid tokens of this (micro-)batch (Wang et al. 2025: ρ = 0.2); the loss then
    averages over those. The KL, value and entropy terms keep every valid token. None (every token) when every
    token is valid and ``policy_loss`` is one of the losses that then take plain means (``ALL_VALID_LOSSES``)."""
    if top_entropy_quantile >= 1.0:
        return batch.reduction_mask if policy_loss in ALL_VALID_LOSSES else batch.mask
    if batch.entropy is None:
        raise ValueError(
            f"estimator.top_entropy_quantile ({top_entropy_quantile}) selects tokens by entropy, which this learner "
            "does not compute; set it to 1"
        )
    return top_fraction_mask(batch.entropy, batch.mask, top_entropy_quantile)


def off_policy_weights(
    settings: EstimatorConfig,
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    age: torch.Tensor | None = None,
) -> OffPolicyWeights | None:
    """The configured off-policy weight w(ρ, age) (B, T) of the unified objective, or None for 'none'.

    ``age`` (B,) or (B, T) is the current policy version minus the behaviour version (0 when synchronous).
    """
    if settings.off_policy_weight == "none":
        return None
    data = {
        "logprobs": logprobs,
        "behaviour_logprobs": behaviour_logprobs,
        "mask": mask,
        "age": torch.zeros_like(mask) if age is None else age,
    }
    return OFF_POLICY_WEIGHTS.call(settings.off_policy_weight, data, settings)


def importance_ess(batch: ObjectiveBatch, weights: torch.Tensor | None) -> float:
    """Normalised effective sample size of the importance weights ρ·w over the valid tokens (``weights`` (B, T)
    w, None: 1)."""
    rho = (batch.logprobs.detach() - batch.behaviour_logprobs).exp() * batch.mask
    if weights is not None:
        rho = rho * weights
    return float(weight_metrics(rho, batch.mask)["ess"])


def fresh_tokens(mask: torch.Tensor, age: torch.Tensor | None) -> torch.Tensor:
    """(B, T) bool: the valid tokens of ``mask`` sampled at the learner's current version (``age`` (B,) or (B, T)
    is 0 there; None: every token)."""
    valid = mask.bool()
    if age is None:
        return valid
    age = age if age.dim() == mask.dim() else age.unsqueeze(-1)
    return valid & (age == 0)


def engine_correction(batch: ObjectiveBatch, tis_cap: float | None) -> tuple[ObjectiveBatch, torch.Tensor | None]:
    """The batch as the policy loss reads it with the engine gap corrected, and the detached weight w_tis (B, T):
    on age-0 tokens μ replaced by π_trainer_old and w_tis = min(π_trainer_old/μ_engine, tis_cap), elsewhere μ
    kept and w_tis = 1 (module docstring). ``batch`` and None unchanged when ``tis_cap`` is None."""
    if tis_cap is None:
        return batch, None
    if batch.proximal_logprobs is None:
        raise ValueError(
            "correcting the engine gap needs the trainer's log-probs before the update "
            "(ObjectiveBatch.proximal_logprobs); compute them with the weights that sampled the batch"
        )
    fresh = fresh_tokens(batch.mask, batch.age)
    tis = engine_mismatch_weights(batch.proximal_logprobs, batch.behaviour_logprobs, fresh, cap=tis_cap).weights
    weights = torch.where(fresh, tis, torch.ones_like(tis)) * batch.mask.to(tis.dtype)
    behaviour = torch.where(fresh, batch.proximal_logprobs, batch.behaviour_logprobs)
    return replace(batch, behaviour_logprobs=behaviour), weights


def mismatch_metrics(batch: "LMBatch", cap: float) -> dict[str, float]:
    """The gap between the trainer's log-probs before the update (``proximal_logprobs``) and the engine's
    (``behaviour_logprobs``) on the batch's tokens of the current version: ``mismatch/k3`` (KL(μ_engine‖π_trainer)),
    ``mismatch/max_ratio``, ``mismatch/fraction_capped`` (share above ``cap``) and ``mismatch/tokens``, how many
    tokens were compared (only this when every token is stale)."""
    fresh = fresh_tokens(batch.completion_mask, batch.ages)
    metrics = {"mismatch/tokens": float(fresh.sum())}
    if metrics["mismatch/tokens"] > 0:
        gap = engine_mismatch_weights(batch.proximal_logprobs, batch.behaviour_logprobs, fresh, cap=cap)
        metrics.update(
            {f"mismatch/{name}": float(gap.metrics[name]) for name in ("k3", "max_ratio", "fraction_capped")}
        )
    return metrics


def micro_batch_share(mask: torch.Tensor, batch_mask: torch.Tensor, *, mode: str, norm_length: int | None) -> float:
    """Weight of a micro-batch's loss (``mask`` (b, t)) so that the weighted sum over the micro-batches of a
    mini-batch (``batch_mask`` (B, T)) is the mini-batch's loss under aggregation ``mode``.

    token-mean: its share of the tokens; seq-mean-token-sum-norm: b/B · t/``norm_length``, so that every
    micro-batch divides by the constant B · norm_length; the seq-mean modes: its share of the sequences that
    have a token.
    """
    if mode == "token-mean":
        return float(mask.sum() / batch_mask.sum().clamp(min=1))
    if mode == "seq-mean-token-sum-norm":
        return len(mask) / len(batch_mask) * mask.shape[1] / norm_length
    has_tokens = lambda m: float((m.sum(1) > 0).sum())
    return has_tokens(mask) / max(has_tokens(batch_mask), 1.0)
