"""Where each registered estimator sits in the family J = E_μ[ρ · A · w(ρ, age)]: the axes a method chooses.

A policy loss picks the level its ratio ρ is taken at and the shape of its weight w(ρ); an advantage estimator
picks its baseline. ``unipg algorithms`` and docs/algorithms.md print these next to each preset's aggregation and
KL placement. An estimator registered without an entry here (a plugin's) shows as "–".
"""

from __future__ import annotations

# policy loss → (ratio level, weight shape)
LOSS_AXES: dict[str, tuple[str, str]] = {
    "vanilla": ("none (ρ ≡ 1)", "none: REINFORCE"),
    "ppo": ("token", "hard clip [1−ε_low, 1+ε_high] (+ dual clip)"),
    "decoupled_ppo": ("token, against π_prox", "hard clip, × capped π_prox/μ"),
    "gspo": ("sequence (length-normalised)", "hard clip"),
    "gspo_token": ("sequence value, token gradient", "hard clip"),
    "luspo": ("sequence (length-normalised)", "hard clip, × response length"),
    "vespo": ("sequence (product of token ratios)", "smooth kernel W^k e^{λ(1−W)}, gradient stopped"),
    "gmpo": ("sequence (geometric mean)", "per-token clip in log space"),
    "cispo": ("token", "clipped weight, gradient stopped"),
    "sapo": ("token", "soft sigmoid gate, τ by sign of A"),
    "clip_cov": ("token", "hard clip + drop high-covariance tokens"),
    "kl_cov": ("token", "none + |log ρ| on high-covariance tokens"),
    "trpo": ("token", "KL trust region (natural gradient)"),
}

# advantage estimator → baseline (and scale)
ADVANTAGE_BASELINES: dict[str, str] = {
    "gae": "critic V(s), GAE(λ)",
    "td": "critic V(s), one step",
    "value_baseline": "critic V(s)",
    "reward_to_go": "none",
    "batch_mean_baseline": "batch mean return",
    "reinforce_plus_plus": "none, whitened over the batch",
    "grpo": "group mean, / group (or batch) std",
    "dr_grpo": "group mean",
    "rloo": "leave-one-out group mean",
    "opo": "length-weighted group mean",
    "grpo_passk": "group runner-up, best sample only",
    "reinforce_plus_plus_baseline": "group mean, whitened over the batch",
    "gpg": "group mean, × informative share",
    "remax": "reward of the greedy response",
    "turn_level": "per-turn leave-one-out mean",
    "optimal_token_baseline": "group, per token, weighted by path energy",
}


def loss_axes(name: str) -> tuple[str, str]:
    """(ratio level, weight shape) of policy loss ``name``; ("–", "–") when unknown."""
    return LOSS_AXES.get(name, ("–", "–"))


def baseline_of(name: str) -> str:
    """The baseline of advantage estimator ``name``; "–" when unknown."""
    return ADVANTAGE_BASELINES.get(name, "–")
