"""Advantage estimators: how much better an action was than expected.

Shape convention: batch first, time last. ``rewards``, ``values``, ``dones`` and ``mask`` are (B, T);
``dones[b, t] = 1`` means the episode ended at step t, so no return flows back across it;
``bootstrap_value`` (B,) is V of the state after the last step, used when that step is not done.
Padding after an episode's end is harmless when its last valid step is marked done, or when padded
rewards and values are 0 (and the bootstrap is 0).

The registered estimators come in three families, each told by the inputs its entry declares
(``advantage_family``), and the caller passes arguments by name:

- step (neither ``scores`` nor ``turn_rewards``): over step rewards (B, T), "gae", "td", "reward_to_go",
  "batch_mean_baseline", "value_baseline", "reinforce_plus_plus" return ``(advantages, returns)``, both (B, T);
  ``returns`` is the value-regression target (for critic-free estimators, the reward-to-go).
- group (``scores``): over sequence scores (N,), "grpo", "dr_grpo", "rloo" return advantages (N,); the N samples
  come in consecutive groups of ``group_size`` per prompt. Spread them over tokens with ``broadcast_to_tokens``.
- turn (``turn_rewards``): over the (N, K) rewards of the K policy turns of N episodes, "turn_level" returns
  advantages (N, K).

An estimator that reads ``values`` needs a critic (``needs_critic``); one that reads ``greedy_scores`` needs the reward
of a greedy episode of each prompt (``needs_greedy_baseline``).
"""

from __future__ import annotations

import torch

from unipg.estimate.masked import masked_mean, masked_whiten
from unipg.registry import Registry

ADVANTAGES = Registry("advantage estimator")
# What the per-step estimators read: rewards and episode ends, V(s_T) of unfinished episodes, and V(s_t).
_MONTE_CARLO_INPUTS = ("rewards", "dones", "bootstrap_value")
_CRITIC_INPUTS = ("rewards", "values", "dones", "bootstrap_value")


def advantage_family(name: str) -> str:
    """Which data estimator ``name`` reads, from the inputs its entry declares: "group" (``scores``: one score per
    sample, compared within its prompt's group), "turn" (``turn_rewards``: one reward per policy turn) or "step"
    (per-step rewards). An unknown name raises ``RegistryError`` listing the valid ones."""
    inputs = ADVANTAGES.entry(name).inputs
    if "scores" in inputs:
        return "group"
    if "turn_rewards" in inputs:
        return "turn"
    return "step"


def needs_critic(name: str) -> bool:
    """Whether estimator ``name`` reads a learned value V(s_t) (its declared inputs hold ``values``)."""
    return "values" in ADVANTAGES.entry(name).inputs


def needs_greedy_baseline(name: str) -> bool:
    """Whether estimator ``name`` compares each sample with a greedy episode of its prompt (its declared inputs hold
    ``greedy_scores``: remax), which the run then generates for every prompt it trains on."""
    return "greedy_scores" in ADVANTAGES.entry(name).inputs


def advantage_names(family: str) -> list[str]:
    """The registered estimators of ``family`` ("step", "group" or "turn"), sorted."""
    return [name for name in ADVANTAGES.names() if advantage_family(name) == family]


def _discounted_backward_sum(
    values: torch.Tensor, discounts: torch.Tensor, initial: torch.Tensor | None = None
) -> torch.Tensor:
    """y_t = x_t + d_t · y_{t+1}, with y_T = ``initial`` (B,) or 0; one vectorised step per time index."""
    out = torch.empty_like(values)  # (B, T)
    running = torch.zeros_like(values[:, 0]) if initial is None else initial.to(values.dtype)  # (B,)
    for t in reversed(range(values.shape[-1])):
        running = values[:, t] + discounts[:, t] * running
        out[:, t] = running
    return out


def _not_done(dones: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return 1.0 - dones.to(like.dtype)  # (B, T) 1 where the return flows on to t+1


def reward_to_go(
    rewards: torch.Tensor,
    dones: torch.Tensor,
    *,
    gamma: float,
    bootstrap_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Discounted return G_t = r_t + γ (1 − done_t) G_{t+1}, with G_T = ``bootstrap_value`` (default 0).

    Returns (B, T). The Monte-Carlo target of REINFORCE (Williams 1992; Sutton & Barto eq. 3.9).
    """
    return _discounted_backward_sum(rewards, gamma * _not_done(dones, rewards), bootstrap_value)


def td_residuals(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    *,
    gamma: float,
    bootstrap_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """One-step TD error δ_t = r_t + γ (1 − done_t) V_{t+1} − V_t, with V_T = ``bootstrap_value`` or 0.

    Returns (B, T). Schulman et al. 2016 (GAE), eq. 9.
    """
    if bootstrap_value is None:
        bootstrap_value = torch.zeros_like(values[:, 0])
    next_values = torch.cat([values[:, 1:], bootstrap_value.to(values.dtype)[:, None]], dim=-1)  # (B, T)
    return rewards + gamma * _not_done(dones, rewards) * next_values - values


@ADVANTAGES.register("gae", inputs=_CRITIC_INPUTS, options={"gamma": "gamma", "lambda_gae": "lam"})
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    bootstrap_value: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, eq. 16):

        A_t = δ_t + γλ (1 − done_t) A_{t+1},    returns_t = A_t + V_t.

    λ = 0 gives the TD residual, λ = 1 the reward-to-go minus V. Returns (advantages, returns), (B, T).
    """
    deltas = td_residuals(rewards, values, dones, gamma=gamma, bootstrap_value=bootstrap_value)
    advantages = _discounted_backward_sum(deltas, gamma * lam * _not_done(dones, rewards))
    return advantages, advantages + values


@ADVANTAGES.register("td", inputs=_CRITIC_INPUTS, options=("gamma",))
def td_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    *,
    gamma: float,
    bootstrap_value: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One-step actor-critic advantage A_t = δ_t (GAE with λ = 0); returns_t = δ_t + V_t (TD(0) target)."""
    deltas = td_residuals(rewards, values, dones, gamma=gamma, bootstrap_value=bootstrap_value)
    return deltas, deltas + values


@ADVANTAGES.register("reward_to_go", inputs=_MONTE_CARLO_INPUTS, options=("gamma",))
def reward_to_go_advantages(
    rewards: torch.Tensor,
    dones: torch.Tensor,
    *,
    gamma: float,
    bootstrap_value: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE without a baseline: A_t = G_t. Returns (G, G)."""
    returns = reward_to_go(rewards, dones, gamma=gamma, bootstrap_value=bootstrap_value)
    return returns, returns


@ADVANTAGES.register("batch_mean_baseline", inputs=(*_MONTE_CARLO_INPUTS, "mask"), options=("gamma",))
def batch_mean_baseline_advantages(
    rewards: torch.Tensor,
    dones: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    bootstrap_value: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE with a constant baseline: A_t = G_t − mean(G) over the valid entries; padding → 0.

    Returns (advantages, G).
    """
    returns = reward_to_go(rewards, dones, gamma=gamma, bootstrap_value=bootstrap_value)
    advantages = (returns - masked_mean(returns, mask)) * mask.to(returns.dtype)
    return advantages, returns


@ADVANTAGES.register("value_baseline", inputs=_CRITIC_INPUTS, options=("gamma",))
def value_baseline_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    *,
    gamma: float,
    bootstrap_value: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE with a learned state-value baseline: A_t = G_t − V(s_t) (GAE with λ = 1).

    Returns (advantages, G).
    """
    returns = reward_to_go(rewards, dones, gamma=gamma, bootstrap_value=bootstrap_value)
    return returns - values, returns


def _grouped(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N,) → (N / group_size, group_size), after checking the group layout."""
    if scores.dim() != 1:
        raise ValueError(f"group scores must be one score per sample, shape (N,); got {tuple(scores.shape)}")
    if group_size < 2:
        raise ValueError(
            f"group_size ({group_size}) must be at least 2: a group-relative advantage compares "
            "several samples of the same prompt; raise samples_per_prompt"
        )
    if scores.numel() % group_size != 0:
        raise ValueError(
            f"number of samples ({scores.numel()}) must be a multiple of group_size ({group_size}); "
            "every prompt needs a full group of consecutive samples"
        )
    if not scores.is_floating_point():
        scores = scores.to(torch.get_default_dtype())
    return scores.reshape(-1, group_size)


GROUP_SCALES = ("group", "batch", "none")


@ADVANTAGES.register(
    "grpo", inputs=("scores", "group_size"), options={"scale_rewards": "scale", "advantage_eps": "eps"}
)
def group_normalized_advantages(
    scores: torch.Tensor, *, group_size: int, scale: str = "group", eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantage (Shao et al. 2024, GRPO, outcome supervision):

        A_i = (r_i − mean_g(r)) / (σ + ε)     over the group g of sample i,

    with σ by ``scale``: "group", the unbiased (Bessel-corrected) std of the group (GRPO as published);
    "batch", the std of every score of the call, which keeps the scale of a group whose samples nearly agree
    (Liu et al. 2025, "Tricks or Traps", group mean with batch std; TRL scale_rewards="batch"); "none", no
    division (Dr.GRPO, Liu et al. 2025: the group std up-weights prompts that are too easy or too hard).
    ``scores`` (N,) holds ``group_size`` consecutive samples per prompt; returns (N,).
    """
    if scale not in GROUP_SCALES:
        raise ValueError(f"unknown scale_rewards '{scale}'; valid: {', '.join(GROUP_SCALES)}")
    grouped = _grouped(scores, group_size)  # (N / G, G)
    centred = grouped - grouped.mean(dim=-1, keepdim=True)
    if scale == "group":
        centred = centred / (grouped.std(dim=-1, keepdim=True) + eps)
    elif scale == "batch":
        centred = centred / (grouped.std() + eps)
    return centred.reshape(-1)


@ADVANTAGES.register("dr_grpo", inputs=("scores", "group_size"))
def dr_grpo_advantages(scores: torch.Tensor, *, group_size: int) -> torch.Tensor:
    """Dr.GRPO (Liu et al. 2025): A_i = r_i − mean_g(r), GRPO without the std division. (N,) → (N,)."""
    return group_normalized_advantages(scores, group_size=group_size, scale="none")


@ADVANTAGES.register("rloo", inputs=("scores", "group_size"))
def rloo_advantages(scores: torch.Tensor, *, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024; Kool et al. 2019):

        A_i = r_i − 1/(G−1) Σ_{j≠i} r_j      over the group of sample i (G = group_size ≥ 2).

    The baseline excludes r_i, so it is independent of sample i and the estimate stays unbiased.
    ``scores`` (N,) holds ``group_size`` consecutive samples per prompt; returns (N,).
    """
    grouped = _grouped(scores, group_size)  # (N / G, G)
    others_mean = (grouped.sum(dim=-1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others_mean).reshape(-1)


@ADVANTAGES.register("reinforce_plus_plus", inputs=("rewards", "mask"), options=("gamma",))
def reinforce_plus_plus_advantages(
    rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0, eps: float = 1e-8
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): token-level reward-to-go, whitened over the whole batch.

        G_t = Σ_{k ≥ t, m_k = 1} γ^{n(t, k)} r_k,     A = (G − mean(G)) / std(G)   over valid tokens,

    where n(t, k) counts the valid tokens in [t, k): discounting steps over the policy's own tokens
    only, so tool or prompt tokens in between (mask 0) neither earn reward nor cost a discount.
    ``rewards`` (B, T) usually holds the sequence reward on the last valid token (minus a per-token KL
    penalty). Returns (advantages, G), both 0 on padding.
    """
    valid = mask.to(rewards.dtype)  # (B, T)
    discounts = gamma * valid + (1.0 - valid)  # (B, T) a masked step passes the return through
    returns = _discounted_backward_sum(rewards * valid, discounts) * valid
    return masked_whiten(returns, mask, eps=eps), returns


@ADVANTAGES.register("turn_level", inputs=("turn_rewards", "turn_mask", "group_size"), options=("gamma",))
def turn_level_advantages(
    turn_rewards: torch.Tensor, turn_mask: torch.Tensor, *, group_size: int, gamma: float = 1.0
) -> torch.Tensor:
    """Per-turn advantages of multi-turn episodes: discounted return over turns minus a per-turn baseline.

        G_{i,k} = Σ_{j ≥ k} γ^{j−k} r_{i,j},     A_{i,k} = G_{i,k} − mean_{i' ≠ i, turn k exists} G_{i',k},

    with r_{i,k} the reward of turn k of episode i (process rewards, tool penalties, and the final reward
    on the last turn). The baseline averages the same turn index over the *other* episodes of the group
    (leave-one-out, as in RLOO), so it does not depend on episode i and the estimate stays unbiased; where
    no other episode of the group reached turn k it falls back to the others' episode returns G_{·,0}.
    A turn is credited with what followed it, not with what preceded it, which lowers variance compared
    with one episode-level advantage on every token; γ < 1 lowers it further at the price of bias toward
    near rewards. ``turn_rewards``, ``turn_mask`` (N, K): N episodes in consecutive groups of
    ``group_size``; returns (N, K), 0 on missing turns.
    """
    valid = turn_mask.to(turn_rewards.dtype)  # (N, K)
    returns = reward_to_go(turn_rewards * valid, torch.zeros_like(valid), gamma=gamma) * valid  # (N, K)
    n, k = returns.shape
    grouped, grouped_valid = returns.reshape(-1, group_size, k), valid.reshape(-1, group_size, k)
    peers_sum = grouped.sum(1, keepdim=True) - grouped  # (N/G, G, K) Σ over the other episodes
    peers_count = grouped_valid.sum(1, keepdim=True) - grouped_valid
    episode_peers = (peers_sum[..., :1] / (group_size - 1)) if group_size > 1 else torch.zeros_like(peers_sum[..., :1])
    baseline = torch.where(peers_count > 0, peers_sum / peers_count.clamp(min=1), episode_peers)
    return ((grouped - baseline) * grouped_valid).reshape(n, k)


def broadcast_to_tokens(sequence_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) per-sequence value → (B, T): repeated on every valid token, 0 on padding."""
    if not sequence_values.is_floating_point():
        sequence_values = sequence_values.to(torch.get_default_dtype())
    return sequence_values[:, None] * mask.to(sequence_values.dtype)


def normalize_advantages(advantages: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True) -> torch.Tensor:
    """Whiten advantages over the valid entries: (A − mean) / std (A / std with ``shift_mean=False``).

    Per-batch normalization as in the PPO reference implementation (Schulman et al. 2017, baselines).
    """
    return masked_whiten(advantages, mask, shift_mean=shift_mean)
