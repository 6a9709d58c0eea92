"""Per-token estimators of KL(π_θ ‖ π_ref) from actions sampled by π_θ.

Following Schulman, "Approximating KL divergence" (2020), with log r = log π_ref(a) − log π_θ(a) for
a ~ π_θ, so that E[r] = 1 and KL(π_θ‖π_ref) = E[−log r]:

- "k1" = −log r: unbiased, high variance, and negative on individual samples.
- "k2" = ½ (log r)²: biased (its mean is an f-divergence that agrees with the KL only to second order
  as π_ref → π_θ), but low variance and never negative.
- "k3" = (r − 1) − log r: unbiased (E[r − 1] = 0 adds a zero-mean control variate to k1), never
  negative (log x ≤ x − 1), and lower variance than k1 when the policies are close; the in-loss KL
  of GRPO (Shao et al. 2024).

``logprobs`` and ``ref_logprobs`` are (B, T); the result is a (B, T) per-token estimate. Reduce it with
``aggregate`` from ``losses``, or subtract β · estimate from the token rewards.
"""

from __future__ import annotations

import torch

from unipg.registry import Registry

KL_ESTIMATORS = Registry("KL estimator")
# What every KL estimator reads: the policy's and the reference's log-probs of the sampled tokens.
_KL_INPUTS = ("logprobs", "ref_logprobs")


@KL_ESTIMATORS.register("k1", inputs=_KL_INPUTS)
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = −log r = log π_θ(a) − log π_ref(a). Unbiased for KL(π_θ‖π_ref); negative on some tokens."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2", inputs=_KL_INPUTS)
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = ½ (log r)². Biased, low variance, ≥ 0."""
    return 0.5 * (ref_logprobs - logprobs) ** 2


@KL_ESTIMATORS.register("k3", inputs=_KL_INPUTS)
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = (r − 1) − log r. Unbiased for KL(π_θ‖π_ref) and ≥ 0.

    Uses expm1 for accuracy when r ≈ 1; the clamp at 0 only removes round-off below zero.
    """
    log_ratio = ref_logprobs - logprobs  # (B, T) log r
    return (torch.expm1(log_ratio) - log_ratio).clamp(min=0.0)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, *, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(π_θ‖π_ref) estimate (B, T) with the named estimator ("k1", "k2" or "k3").

    ``logprobs`` (B, T) log π_θ(a_t|s_t) of the sampled tokens; ``ref_logprobs`` (B, T) log π_ref(a_t|s_t).
    """
    return KL_ESTIMATORS.get(estimator)(logprobs, ref_logprobs)
