"""Text presets that keep GRPO's data — samples_per_prompt completions per prompt, group-normalised advantages, no
critic — and change the policy loss: the ratio level (token or sequence) and the shape of the weight w(ρ); GPG
changes the advantage's scale instead and drops the ratio.

Each entry is (summary, estimator settings, train settings); ``unipg.config.presets`` defines them as algorithms.
What they share, and why:

- no KL term (``kl_coef`` 0): none of these papers' objectives carries one, so ``kl_estimator`` (k3) only names
  what ``kl_to_reference`` reports when a reference model is configured;
- four optimizer steps per batch (``mini_batch_size`` 16 of ``batch_size`` 64), GSPO's setup: only off-policy
  steps move the ratio away from 1, and the ratio's treatment is what sets these methods apart (GPG, which has no
  ratio, keeps one step per batch);
- the reduction each paper uses ("seq-mean-token-mean": every response weighs the same, or "token-mean").
"""

from __future__ import annotations

from typing import Any

_OFF_POLICY_STEPS = {"mini_batch_size": 16}

POLICY_LOSS_PRESETS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "gspo": (
        "GSPO: PPO-clip on the length-normalised sequence ratio (ε_low 3e-4, ε_high 4e-4), group advantages, no KL "
        "(Zheng et al. 2025)",
        {"policy_loss": "gspo", "clip_range": 3e-4, "clip_range_high": 4e-4, "loss_agg_mode": "seq-mean-token-mean"},
        _OFF_POLICY_STEPS,
    ),
    "cispo": (
        "CISPO: REINFORCE weighted by the clipped, gradient-stopped importance weight (no lower bound, ε_high 0.2), "
        "group advantages, token-mean, no KL (MiniMax-M1, 2025)",
        {"policy_loss": "cispo", "weight_clip_low": None, "weight_clip_high": 0.2, "loss_agg_mode": "token-mean"},
        _OFF_POLICY_STEPS,
    ),
    "luspo": (
        "LUSPO: GSPO with each response's loss scaled by its length, so a token's gradient does not shrink in long "
        "responses (GSPO's clip range), group advantages, no KL (Liu et al. 2026)",
        {"policy_loss": "luspo", "clip_range": 3e-4, "clip_range_high": 4e-4, "loss_agg_mode": "seq-mean-token-mean"},
        _OFF_POLICY_STEPS,
    ),
    "vespo": (
        "VESPO: REINFORCE weighted by a smooth kernel W^k e^{λ(1−W)} of the whole response's ratio (k/λ 2/3 for A ≥ 0, "
        "3/2 for A < 0), group advantages, token-mean, no KL (Shen et al. 2026)",
        {
            "policy_loss": "vespo",
            "vespo_k_pos": 2.0,
            "vespo_lambda_pos": 3.0,
            "vespo_k_neg": 3.0,
            "vespo_lambda_neg": 2.0,
            "loss_agg_mode": "token-mean",
        },
        _OFF_POLICY_STEPS,
    ),
    "sapo": (
        "SAPO: a smooth sigmoid gate on the token ratio instead of the clip (τ_pos 1.0, τ_neg 1.05), group "
        "advantages, no KL (Gao et al. 2025)",
        {"policy_loss": "sapo", "sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05, "loss_agg_mode": "seq-mean-token-mean"},
        _OFF_POLICY_STEPS,
    ),
    "gmpo": (
        "GMPO: geometric mean of the token-clipped ratios of a response (log ρ within ±0.4), group advantages, no KL "
        "(Zhao et al. 2025)",
        {"policy_loss": "gmpo", "clip_range": 0.4, "clip_range_high": 0.4, "loss_agg_mode": "seq-mean-token-mean"},
        _OFF_POLICY_STEPS,
    ),
    "clip_cov": (
        "Clip-Cov: PPO-clip that also drops the gradient of a few tokens of high log-prob/advantage covariance, "
        "against entropy collapse (Cui et al. 2025)",
        {
            "policy_loss": "clip_cov",
            "clip_range": 0.2,
            "clip_range_high": 0.28,
            "clip_cov_ratio": 2e-4,
            "clip_cov_lb": 1.0,
            "clip_cov_ub": 5.0,
            "loss_agg_mode": "token-mean",
        },
        _OFF_POLICY_STEPS,
    ),
    "kl_cov": (
        "KL-Cov: unclipped surrogate with a |log ρ| penalty on the tokens of highest log-prob/advantage covariance, "
        "against entropy collapse (Cui et al. 2025)",
        {"policy_loss": "kl_cov", "kl_cov_ratio": 2e-3, "kl_cov_coef": 1.0, "loss_agg_mode": "token-mean"},
        _OFF_POLICY_STEPS,
    ),
    "gpg": (
        "GPG: the plain policy gradient on group-centred scores rescaled by the share of informative groups, no "
        "ratio, clip, critic or KL (Chu et al. 2025)",
        {"advantage": "gpg", "policy_loss": "vanilla", "loss_agg_mode": "token-mean"},
        {},
    ),
}
