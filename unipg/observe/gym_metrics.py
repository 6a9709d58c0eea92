"""What a gym run logs besides its learner's losses: the runtime's figures between two log lines
(``RuntimeMeter``) and the rollout's advantages, returns and episode lengths (``rollout_metrics``)."""

from __future__ import annotations

import statistics

import torch

from unipg.estimate.losses import explained_variance
from unipg.estimate.masked import masked_mean, masked_var
from unipg.observe.rollout_metrics import staleness_histogram


class RuntimeMeter:
    """The runtime's figures over the learner steps between two log lines.

    Maxima stay maxima, counters and waiting times add up, the other figures are averaged; the staleness
    histogram (``async/staleness_step_*``) is over every environment step trained on in the interval.
    """

    SUMMED = ("evicted", "dropped_stale", "_wait", "_seconds")

    def __init__(self):
        self.records: list[dict[str, float]] = []
        self.ages: list[torch.Tensor] = []
        self.masks: list[torch.Tensor] = []

    def add(self, record: dict[str, float], samples: dict[str, torch.Tensor]) -> None:
        self.records.append(record)
        self.ages.append(samples["age"])
        self.masks.append(samples["mask"])

    def pending(self) -> list[tuple[dict[str, float], torch.Tensor, torch.Tensor]]:
        """The (record, ages, masks) added since the last ``pop``, for a checkpoint."""
        return list(zip(self.records, self.ages, self.masks))

    def pop(self) -> dict[str, float]:
        if not self.records:
            return {}
        merged: dict[str, float] = {}
        for key in self.records[0]:
            values = [record[key] for record in self.records if key in record]
            if key.endswith("_max"):
                merged[key] = max(values)
            elif key.endswith(self.SUMMED):
                merged[key] = sum(values)
            else:
                merged[key] = sum(values) / len(values)
        merged.update(staleness_histogram(torch.cat(self.ages), torch.cat(self.masks), "async/staleness_step"))
        self.records, self.ages, self.masks = [], [], []
        return merged


def rollout_metrics(batch, advantages: torch.Tensor, returns: torch.Tensor, recent_returns: list[float]) -> dict:
    mask = batch.mask
    metrics = {
        "train/advantage_mean": float(masked_mean(advantages, mask)),
        "train/advantage_std": float(masked_var(advantages, mask).sqrt()),
        "train/explained_variance": float(explained_variance(batch.values, returns, mask)),
        "rollout/reward_mean": float(masked_mean(batch.rewards, mask)),
        "rollout/valid_fraction": float(mask.mean()),
    }
    if recent_returns:
        metrics["rollout/episode_return"] = statistics.fmean(recent_returns)
    if batch.episode_lengths:
        metrics["rollout/episode_length"] = statistics.fmean(batch.episode_lengths)
    return metrics
