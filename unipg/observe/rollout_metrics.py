"""The rollout metrics of a learner step: what its fresh episodes did (completion, turns, tool use, lengths,
diversity, reward terms, per role), how many of their groups can teach anything, and how stale their tokens are.

``rollout_metrics`` gathers them for the lm driver (``unipg.runtime.lm``); ``episode_metrics`` also measures
evaluation's episodes, and ``staleness_histogram`` the gym driver's steps.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # annotations only: the gym driver reads this module without the language-model stack
    from unipg.learn.lm_batch import LMBatch
    from unipg.sample.agent import Trajectory


def rollout_metrics(
    trajectories: list[Trajectory],
    batch: LMBatch,
    *,
    group_size: int,
    tools: bool,
    wait_seconds: float,
    batch_sizes: list[int],
    generate_seconds: float,
) -> dict[str, float]:
    """The metrics of a step's fresh episodes ``trajectories`` (group after group, each ``group_size`` episodes per
    role), whose rows open ``batch``. ``wait_seconds``: the step's time spent waiting for rollout, of which
    ``generate_seconds`` went to generate calls of ``batch_sizes`` sequences each; ``tools``: the episodes may
    call tools (their metrics are reported even when none did)."""
    online = sum(len(t.rows) for t in trajectories)  # rows: an episode's side ones included
    scores = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)  # (episodes,)
    lengths = batch.completion_mask[:online].sum(1)
    metrics = {
        "rollout/reward_mean": float(scores.mean()),
        "rollout/reward_std": float(scores.std()),
        "rollout/response_length_max": float(lengths.max()),
        "rollout/generated_tokens": float(lengths.sum()),
        "timing/generate": generate_seconds,
        # generation and environment steps interleave: env is the rollout time not spent generating
        "timing/env": max(wait_seconds - generate_seconds, 0.0),
    }
    if batch_sizes:
        metrics["rollout/generate_batch_mean"] = statistics.fmean(batch_sizes)
    metrics.update(episode_metrics(trajectories, "rollout", group_size=group_size, tools=tools))
    metrics.update(role_metrics(trajectories, "rollout", tools=tools))
    metrics.update(reward_term_metrics(trajectories, "rollout"))
    metrics.update(
        group_signal_metrics([t.reward for t in trajectories], [t.correct for t in trajectories], group_size)
    )
    metrics.update(staleness_histogram(batch.ages[:online], batch.completion_mask[:online], "async/staleness_token"))
    return metrics


def uniform_groups(returns: list[float], group_size: int) -> list[bool]:
    """Whether the returns of each group (each run of ``group_size`` consecutive ``returns``: a group's episodes
    of one role) are all equal. A group-relative advantage (GRPO, RLOO) is then zero for every one of its
    episodes, so the group teaches nothing: ``rollout/uniform_group_fraction`` counts such groups, and dynamic
    sampling replaces them (``unipg.runtime.lm_run.mixed_returns``).

    >>> uniform_groups([1.0, 1.0, 0.0, 1.0], 2)
    [True, False]
    """
    return [len(set(returns[start : start + group_size])) == 1 for start in range(0, len(returns), group_size)]


def group_signal_metrics(returns: list[float], correct: list[bool], group_size: int) -> dict[str, float]:
    """How many prompt groups can teach anything. ``returns``: the episode returns, group after group;
    ``correct``: whether each episode completed the task.

    - ``rollout/uniform_group_fraction``: groups whose returns are all equal (``uniform_groups``); 0 with one
      episode per prompt, where there is no group to compare;
    - ``rollout/unsolved_group_fraction``: groups in which no episode completed the task;
    - ``rollout/solved_group_fraction``: groups in which every episode did.
    """
    grouped = torch.tensor(correct, dtype=torch.bool).view(-1, group_size)
    uniform = torch.tensor(uniform_groups(returns, group_size) if group_size > 1 else [False])
    return {
        "rollout/uniform_group_fraction": float(uniform.float().mean()),
        "rollout/unsolved_group_fraction": float((~grouped.any(dim=1)).float().mean()),
        "rollout/solved_group_fraction": float(grouped.all(dim=1).float().mean()),
    }


def staleness_histogram(ages: torch.Tensor, mask: torch.Tensor, prefix: str, buckets: int = 8) -> dict[str, float]:
    """Mean, max and the share of tokens at each age 0 … ``buckets`` (the last bucket: that age or older)."""
    valid = ages[mask.bool()]
    if valid.numel() == 0:
        return {}
    metrics = {f"{prefix}_mean": float(valid.float().mean()), f"{prefix}_max": float(valid.max())}
    top = int(valid.max())
    for age in range(min(top, buckets) + 1):
        share = (valid >= age) if age == buckets else (valid == age)
        metrics[f"{prefix}_frac_{age}"] = float(share.float().mean())
    return metrics


def episode_metrics(
    trajectories: list[Trajectory], prefix: str, *, group_size: int = 1, tools: bool = False
) -> dict[str, float]:
    """Task completion, turns, tool use (with ``tools``, or whenever a tool was called), lengths and diversity
    of a list of episodes. The tool success rate is reported only when there were calls."""
    calls = sum(t.tool_calls for t in trajectories)
    sampled = [sum(t.loss_mask) for t in trajectories]
    metrics = {
        f"{prefix}/completion_rate": statistics.fmean(t.correct for t in trajectories),
        f"{prefix}/turns": statistics.fmean(t.turns for t in trajectories),
        f"{prefix}/response_length": statistics.fmean(sampled),
        f"{prefix}/truncated_fraction": statistics.fmean(t.finish != "done" for t in trajectories),
    }
    if tools or calls:
        metrics[f"{prefix}/tool_calls"] = calls / len(trajectories)
        if calls:
            metrics[f"{prefix}/tool_success_rate"] = sum(t.tool_status_count("ok") for t in trajectories) / calls
        metrics[f"{prefix}/malformed_call_rate"] = sum(t.tool_status_count("malformed") for t in trajectories) / max(
            sum(t.turns for t in trajectories), 1
        )
    finals = [t.turn_texts[-1] if t.turn_texts else "" for t in trajectories]
    if group_size > 1:
        groups = [finals[i : i + group_size] for i in range(0, len(finals), group_size)]
        metrics[f"{prefix}/distinct_1"] = statistics.fmean(distinct_n(g, 1) for g in groups)
        metrics[f"{prefix}/distinct_2"] = statistics.fmean(distinct_n(g, 2) for g in groups)
        metrics[f"{prefix}/duplicate_fraction"] = statistics.fmean(duplicate_fraction(g) for g in groups)
    return metrics


def role_metrics(trajectories: list[Trajectory], prefix: str, *, tools: bool = False) -> dict[str, float]:
    """Per role of multi-role episodes (none for one-role episodes): ``<prefix>/<role>/reward_mean``,
    response length, turns and tool use of that role's trajectories."""
    roles = dict.fromkeys(t.role for t in trajectories if t.role is not None)
    metrics = {}
    for role in roles:
        mine = [t for t in trajectories if t.role == role]
        metrics[f"{prefix}/{role}/reward_mean"] = statistics.fmean(t.reward for t in mine)
        for key, value in episode_metrics(mine, f"{prefix}/{role}", tools=tools).items():
            if not key.endswith(("completion_rate", "truncated_fraction")):
                metrics[key] = value
    return metrics


def distinct_n(texts: list[str], n: int) -> float:
    """Distinct n-grams / all n-grams over the texts (Li et al. 2016); words, or characters for one-word texts."""
    grams = []
    for text in texts:
        units = text.split() if len(text.split()) > 1 else list(text)
        grams += [tuple(units[i : i + n]) for i in range(len(units) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def duplicate_fraction(texts: list[str]) -> float:
    """Share of texts that repeat an earlier one exactly: 0 when all differ, (G−1)/G when all are the same."""
    counts = Counter(texts)
    return sum(count - 1 for count in counts.values()) / len(texts) if texts else 0.0


REWARD_NONE_FRACTION = "reward_none_fraction"  # metric namespace of the fraction a reward function left None


def reward_term_metrics(trajectories: list[Trajectory], prefix: str) -> dict[str, float]:
    """The mean of each final-reward function over the episodes it applied to, and the fraction of scored final
    answers it returned None for (``<prefix>/reward_none_fraction/<name>``; 1.0: it scored none of the batch)."""
    scored = [
        trajectory.infos[-1]
        for trajectory in trajectories
        if trajectory.infos and trajectory.infos[-1].reward_terms is not None
    ]
    values: dict[str, list[float]] = {}
    for info in scored:
        for name, value in info.reward_terms.items():
            values.setdefault(name, []).append(value)
    metrics = {f"{prefix}/reward_{name}": statistics.fmean(v) for name, v in values.items()}
    names = dict.fromkeys(name for info in scored for name in (*info.reward_terms, *info.reward_none))
    for name in names:
        metrics[f"{prefix}/{REWARD_NONE_FRACTION}/{name}"] = statistics.fmean(
            name in info.reward_none for info in scored
        )
    return metrics
