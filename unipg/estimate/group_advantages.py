"""More group advantage estimators: one score per sample, ``group_size`` consecutive samples per prompt, (N,) → (N,).

Beside GRPO, Dr.GRPO and RLOO (``unipg.estimate.advantages``), the baselines and scales verl users pick:

- "opo": the length-weighted group mean, the variance-optimal baseline of Hao et al. 2025;
- "grpo_passk": credit only the group's best sample, for pass@k training;
- "reinforce_plus_plus_baseline": the group mean, then whitened over the whole batch (REINFORCE++ with a baseline);
- "gpg": the group mean, rescaled by the share of samples that carry a signal (GPG);
- "remax": the reward of the greedy response to the same prompt (ReMax).

Estimators that weigh samples by length read ``lengths`` (N,): the number of tokens the policy sampled in each.
An estimator that reads ``greedy_scores`` (N,) compares each sample with one greedy (temperature 0) episode of its
prompt that the run generates beside the group and does not train on (``needs_greedy_baseline``).
"""

from __future__ import annotations

import torch

from unipg.estimate.advantages import ADVANTAGES, _grouped

_GROUP_INPUTS = ("scores", "group_size")


@ADVANTAGES.register("opo", inputs=(*_GROUP_INPUTS, "lengths"))
def opo_advantages(scores: torch.Tensor, lengths: torch.Tensor, *, group_size: int) -> torch.Tensor:
    """OPO (Hao et al. 2025, arXiv:2505.23585): the score minus the length-weighted group mean.

    On-policy RL with the optimal reward baseline:

        A_i = r_i − b_g,     b_g = Σ_j |y_j| r_j / Σ_j |y_j|     over the group g of sample i,

    the baseline that minimises the gradient's variance when the squared norm of a response's score function grows
    with its length |y| (``lengths`` (N,)). With equal lengths it is Dr.GRPO's group mean. A group of empty
    responses falls back to the plain mean. The paper trains exactly on-policy (one gradient step per batch).
    """
    grouped = _grouped(scores, group_size)  # (N / G, G)
    weights = _grouped(lengths, group_size).to(grouped.dtype)
    weights = torch.where(weights.sum(-1, keepdim=True) > 0, weights, torch.ones_like(weights))
    baseline = (weights * grouped).sum(-1, keepdim=True) / weights.sum(-1, keepdim=True)
    return (grouped - baseline).reshape(-1)


@ADVANTAGES.register("grpo_passk", inputs=_GROUP_INPUTS, options={"advantage_eps": "eps"})
def grpo_passk_advantages(scores: torch.Tensor, *, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO for pass@k (verl's grpo_passk, after arXiv:2503.19595): only a group's best sample is reinforced.

    It is credited with its margin over the runner-up,

        A_i = (r_(1) − r_(2)) / (std_g(r) + ε) for i = the group's best sample (the first on ties), else 0,

    since a group of k samples succeeds at pass@k when its best one does. The group std is Bessel-corrected.
    """
    grouped = _grouped(scores, group_size)  # (N / G, G)
    top = torch.topk(grouped, 2, dim=-1)
    margin = (top.values[:, 0] - top.values[:, 1]) / (grouped.std(dim=-1) + eps)  # (N / G,)
    advantages = torch.zeros_like(grouped)
    advantages.scatter_(1, top.indices[:, :1], margin[:, None])
    return advantages.reshape(-1)


@ADVANTAGES.register("reinforce_plus_plus_baseline", inputs=(*_GROUP_INPUTS, "lengths"))
def reinforce_plus_plus_baseline_advantages(
    scores: torch.Tensor, lengths: torch.Tensor, *, group_size: int, eps: float = 1e-8
) -> torch.Tensor:
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262): group-centred scores, whitened over the batch.

        a_i = r_i − mean_g(r),     A_i = (a_i − mean(a)) / std(a)     over the whole batch,

    where the batch mean and (Bessel-corrected) std weigh each sample by its token count ``lengths`` (N,), as
    whitening the advantage broadcast over every valid token does (verl). The group mean removes the prompt's
    difficulty, the batch std sets one scale for all prompts (a group whose samples nearly agree is not inflated).
    """
    grouped = _grouped(scores, group_size)
    centred = (grouped - grouped.mean(dim=-1, keepdim=True)).reshape(-1)  # (N,)
    weights = lengths.to(centred.dtype)
    total = weights.sum()
    if total <= 0:
        return torch.zeros_like(centred)
    mean = (weights * centred).sum() / total
    variance = (weights * (centred - mean) ** 2).sum() / (total - 1 if total > 1 else total)
    return (centred - mean) / (variance.sqrt() + eps)


@ADVANTAGES.register("gpg", inputs=_GROUP_INPUTS)
def gpg_advantages(scores: torch.Tensor, *, group_size: int) -> torch.Tensor:
    """GPG (Chu et al. 2025, arXiv:2504.02546): group-centred scores rescaled by the share of informative groups.

        A_i = α · (r_i − mean_g(r)),     α = N / (N − M),

    with M the samples of groups whose scores all agree (they carry no gradient): α restores the gradient's scale
    that those samples dilute in a token or sequence mean. F_norm = 1 (no std division). GPG pairs it with the
    plain policy gradient (policy loss 'vanilla') and no KL. (verl's gpg counts the non-zero raw scores instead.)
    """
    grouped = _grouped(scores, group_size)  # (N / G, G)
    centred = grouped - grouped.mean(dim=-1, keepdim=True)
    informative = (grouped != grouped[:, :1]).any(dim=-1)  # (N / G,) the group's scores differ
    count = int(informative.sum()) * group_size
    alpha = scores.numel() / count if count else 1.0
    return (alpha * centred).reshape(-1)


@ADVANTAGES.register("remax", inputs=("scores", "greedy_scores"))
def remax_advantages(scores: torch.Tensor, greedy_scores: torch.Tensor) -> torch.Tensor:
    """ReMax (Li et al. 2023, arXiv:2310.10505): the score minus that of the greedy response to the same prompt.

    REINFORCE with the greedy baseline of the paper's Algorithm 1,

        A_i = r(x_i, y_i) − b(x_i),     b(x) = r(x, ŷ),     ŷ_t = argmax_a π_θ(a | x, ŷ_<t),

    scored by the same reward function; every token of y_i carries A_i. ``greedy_scores`` (N,) holds b(x_i) for
    each sample, so samples of one prompt share it. b does not depend on y_i, so the estimate stays unbiased
    whatever the group size (the paper samples one response per prompt); a sample that scores as the greedy
    response has no advantage.
    """
    if scores.shape != greedy_scores.shape or scores.dim() != 1:
        raise ValueError(
            f"remax needs one greedy score per sample, shape (N,) like scores {tuple(scores.shape)}; "
            f"got {tuple(greedy_scores.shape)}"
        )
    if not scores.is_floating_point():
        scores = scores.to(torch.get_default_dtype())
    return scores - greedy_scores.to(scores.dtype)
