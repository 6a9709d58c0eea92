"""The optimal token baseline (OTB): a group baseline per token position, weighted by how uncertain each sampled
path has been so far.

From arXiv:2602.07078 (2026) and verl's ``optimal_token_baseline`` (its docs/algo/otb.md). For the N samples of one
prompt, with G_t the reward-to-go from token t, the baseline that minimises the variance of Σ_t (G_t − b_t) ∇log π_t
is b*_t = E[G_t W_t] / E[W_t], where W_t = Σ_{j ≤ t} ‖∇_z log π(a_j)‖² is the "realized energy" of the path up to t.
The logit-gradient proxy gives each term from a forward pass alone: the gradient of log softmax at the sampled token
with respect to the logits is e_a − π, whose squared norm is 1 − 2 π(a_j) + Σ_v π_v². The learner computes Σ_v π_v²
per token (``sum_of_squared_probabilities``) when the estimator asks for ``sum_pi_squared``.

Shapes: (B, T) per token, ``mask`` 1 on the tokens the policy sampled; a row is one trajectory and ``group_index``
(B,) names the prompt group it belongs to. Positions t count the sampled tokens of each row (the learner hands the
sampled tokens packed to the left, inserted tool output removed), so t is "the t-th token the policy chose".
"""

from __future__ import annotations

import torch

from unipg.estimate.advantages import ADVANTAGES


def sum_of_squared_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """Σ_v π_v² of softmax(logits) over the last dimension, (…, V) → (…): exp(logsumexp(2z) − 2 logsumexp(z)),
    which stays finite for large logits."""
    return torch.exp(torch.logsumexp(2.0 * logits, dim=-1) - 2.0 * torch.logsumexp(logits, dim=-1))


@ADVANTAGES.register(
    "optimal_token_baseline", inputs=("rewards", "mask", "behaviour_logprobs", "sum_pi_squared", "group_index")
)
def optimal_token_baseline_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    group_index: torch.Tensor,
    *,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OTB (arXiv:2602.07078, verl): the reward-to-go minus a per-position baseline weighted by each path's energy.

    Optimal token baseline, over the samples i of a group at each token position t:

        G_t = Σ_{k ≥ t} r_k,    W_t = Σ_{j ≤ t} (1 − 2 π_j + Σ_v π_{j,v}²),    b_t = Σ_i G^i_t W^i_t / (Σ_i W^i_t + ε),
        A_t = G_t − b_t,

    the sums over i running over the samples that reach position t. π_j = exp(``behaviour_logprobs``) is the
    probability the sampling policy gave the chosen token, ``sum_pi_squared`` (B, T) Σ_v π_{j,v}² of its whole
    distribution. Where only one sample of the group reaches t (the tail of the longest, or a group of one) the
    baseline is 0, as verl's handle_zero_tail: its own return would leave it no signal. With W the same on every
    path this is the group mean of the reward-to-go at each position. Returns (advantages, G), 0 on padding.
    """
    valid = mask.to(rewards.dtype)
    returns = (rewards * valid).flip(-1).cumsum(-1).flip(-1) * valid  # (B, T) G_t
    energy = ((1.0 - 2.0 * behaviour_logprobs.exp() + sum_pi_squared) * valid).cumsum(-1) * valid  # (B, T) W_t
    groups = torch.unique(group_index, return_inverse=True)[1]  # (B,) groups numbered 0..n-1
    count = int(groups.max()) + 1 if len(groups) else 0

    def group_sum(values: torch.Tensor) -> torch.Tensor:  # (B, T) → (n, T) summed over each group's rows
        return values.new_zeros((count, values.shape[1])).index_add_(0, groups, values)

    baseline = group_sum(returns * energy) / (group_sum(energy) + eps)  # (n, T)
    shared = group_sum(valid) > 1  # (n, T) more than one sample reaches t
    baseline = torch.where(shared, baseline, torch.zeros_like(baseline))[groups]  # (B, T)
    return (returns - baseline) * valid, returns
