"""Offline data (``data.offline``): recorded episodes mixed into the learner's batches beside fresh ones.

Every update a share of the batch's prompt groups comes from the file instead of from rollout (``mix``: a
number, or a linear schedule {start, end, updates}); at least one group stays fresh, and rollout produces that
many fewer groups (``Runtime.next_groups``), so the batch keeps its size. An offline group is
``samples_per_prompt`` records of one prompt for each role recorded for it (drawn without replacement while
the prompt has enough records, with replacement when it has fewer), laid out as an online group is, so group
advantages compare a role's samples on one prompt, as they do online. A record of an external agent that
rewrote its history brings its side trajectories along, each a row beside its main one, as online.

Offline samples enter the unified objective J = E_μ[ρ·A·w(ρ, age)] unchanged; what differs is their μ and age:

- μ: the recorded behaviour log-probs where a record has them (with its token ids); otherwise the policy at
  load time, computed once when the run starts. The latter is an approximation — the data was not drawn from
  that policy — that treats a record as if the starting policy had sampled it; ρ then measures how far the
  policy has moved since, and the configured weight bounds it as for any stale sample.
- age: version −1, one version older than the learner's first weights, so age = learner version + 1,
  growing every update (a record's own versions count another run's updates and are not used); ``age: k``
  fixes every offline sample at k versions old. The weight family (``age_decay``, ``kl_filter``,
  ``version_window``, ``truncated_is``) then decides how much they are trusted; with
  ``off_policy_weight: none`` only the policy loss's clip does.

Metrics: ``offline/share`` (offline rows of the batch), ``offline/mean_weight`` (the mean off-policy weight
w of offline tokens as the update begins; 1 with no weight configured), ``offline/reward_mean``,
``offline/age_mean``.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from collections.abc import Callable

import torch

from unipg.config import Config, ConfigError
from unipg.config.run import OfflineConfig
from unipg.estimate.masked import masked_mean
from unipg.learn import objective
from unipg.learn.lm_batch import LMBatch
from unipg.policy.lm import LMPolicy
from unipg.runtime.replay import Group
from unipg.sample.agent import Trajectory
from unipg.sample.episode_records import read_episode_records, trajectory_from_record
from unipg.sample.episodes import EpisodeRunner


def mix_share(mix, update: int) -> float:
    """The offline share at learner update ``update`` (1-based): a constant, or linear from ``mix.start`` at
    update 1 to ``mix.end`` at update ``mix.updates + 1`` and after.

    >>> from unipg.config.run import MixSchedule
    >>> [round(mix_share(MixSchedule(start=0.5, end=0.0, updates=4), u), 3) for u in (1, 3, 5, 9)]
    [0.5, 0.25, 0.0, 0.0]
    """
    if isinstance(mix, (int, float)):
        return float(mix)
    progress = min(max(update - 1, 0) / mix.updates, 1.0)
    return mix.start + (mix.end - mix.start) * progress


class OfflineData:
    """The loaded episodes of ``data.offline``, by prompt and role, and how many groups each update takes."""

    def __init__(
        self,
        settings: OfflineConfig,
        trajectories: list[Trajectory],
        *,
        group_size: int,
        groups_per_step: int,
        seed: int,
    ):
        self.settings, self.group_size, self.groups_per_step = settings, group_size, groups_per_step
        if settings.only_correct:
            trajectories = [t for t in trajectories if t.correct]
        if not trajectories:
            raise ConfigError(
                f"data.offline.path '{settings.path}' holds no correct episode; drop only_correct "
                "or record a run that solves some prompts"
            )
        self.by_prompt: dict[str, dict[str | None, list[Trajectory]]] = {}
        for trajectory in trajectories:
            roles = self.by_prompt.setdefault(trajectory.example.prompt, {})
            roles.setdefault(trajectory.role, []).append(trajectory)
        self.random = random.Random(seed)
        self._prompts: list[str] = []
        self._unused: dict[tuple, list[Trajectory]] = {}

    def count(self, update: int) -> int:
        """Offline groups in the batch of ``update``: the share of the step's groups, at most all but one."""
        share = mix_share(self.settings.mix, update)
        return min(int(share * self.groups_per_step + 0.5), self.groups_per_step - 1)  # half rounds up

    def take(self, count: int, version: int) -> list[Group]:
        """``count`` offline groups for the learner at ``version`` (prompts in shuffled passes over the file)."""
        groups = []
        for _ in range(count):
            if not self._prompts:
                self._prompts = sorted(self.by_prompt)
                self.random.shuffle(self._prompts)
            prompt = self._prompts.pop()
            items = [t for role, records in self.by_prompt[prompt].items() for t in self._draw(prompt, role, records)]
            if self.settings.age is not None:
                for trajectory in (t for episode in items for t in episode.rows):
                    trajectory.policy_versions = [version - self.settings.age] * len(trajectory.policy_versions)
                    trajectory.version_changes = []
            groups.append(Group(items, -1, self.group_size))
        return groups

    def _draw(self, prompt: str, role: str | None, records: list[Trajectory]) -> list[Trajectory]:
        if len(records) < self.group_size:
            return [self.random.choice(records) for _ in range(self.group_size)]
        unused = self._unused.setdefault((prompt, role), [])
        if len(unused) < self.group_size:
            unused[:] = self.random.sample(records, len(records))
        drawn, unused[:] = unused[: self.group_size], unused[self.group_size :]
        return drawn


def load_offline(
    config: Config, runner: EpisodeRunner, policy: LMPolicy, log: Callable[[str], None] = print
) -> OfflineData | None:
    """The run's ``OfflineData``, with behaviour log-probs computed once where the records have none; None
    without ``data.offline``."""
    settings = config.data.offline
    if settings is None:
        return None
    vocab_size = len(policy.tokenizer)
    roles = runner.roles or [None]
    records = read_episode_records(settings.path)
    kept = [record for record in records if record.get("role") in roles]
    if len(kept) < len(records):
        shown = ", ".join(str(role) for role in roles)
        if not kept:
            raise ConfigError(
                f"data.offline.path '{settings.path}': no episode is of a role of task "
                f"'{runner.task.name}' (roles: {shown}; a one-role task's records have role null)"
            )
        log(
            f"data.offline: {len(records) - len(kept)} of {len(records)} episodes are of roles this task does not "
            f"have (its roles: {shown}) and are left out"
        )
    trajectories = [
        trajectory_from_record(
            record, encode=runner.encoder_for(record.get("role")), template=runner.template, vocab_size=vocab_size
        )
        for record in kept
    ]
    missing = [t for episode in trajectories for t in episode.rows if len(t.behaviour_logprobs) != len(t.token_ids)]
    if missing:
        behaviour_at_load(
            policy, missing, temperature=config.sample.temperature, micro_batch=config.train.micro_batch_size
        )
    if config.estimator.off_policy_weight == "none":
        log(
            "offline data with estimator.off_policy_weight=none: offline samples weigh as fresh ones, bounded only "
            "by the policy loss's clip; age_decay, kl_filter or truncated_is bound them by age or drift"
        )
    return OfflineData(
        settings,
        trajectories,
        group_size=config.sample.samples_per_prompt,
        groups_per_step=config.prompts_per_step,
        seed=config.seed + 20_000,
    )


@torch.no_grad()
def behaviour_at_load(
    policy: LMPolicy, trajectories: list[Trajectory], *, temperature: float, micro_batch: int
) -> None:
    """Set each trajectory's behaviour log-probs to those of ``policy`` now (0 on inserted tokens); a main
    trajectory's side ones only where they are in ``trajectories`` too."""
    for start in range(0, len(trajectories), micro_batch):
        chunk = trajectories[start : start + micro_batch]
        for trajectory in chunk:  # placeholders of the right length, replaced below
            trajectory.behaviour_logprobs = [0.0] * len(trajectory.token_ids)
        batch = LMBatch.from_trajectories([dataclasses.replace(t, side=[]) for t in chunk], policy.pad_id)  # a row each
        logprobs = (
            policy.evaluate(
                batch.input_ids, batch.attention_mask, batch.completion_length, temperature=temperature
            ).logprobs
            * batch.completion_mask
        )
        for row, trajectory in enumerate(chunk):
            trajectory.behaviour_logprobs = logprobs[row, : len(trajectory.token_ids)].tolist()


def current_logprobs(policy: LMPolicy, batch: LMBatch, *, temperature: float, micro_batch: int) -> torch.Tensor:
    """log π of ``batch``'s completion tokens under ``policy`` now, (B, C), a micro-batch at a time."""
    width = batch.completion_length
    parts = []
    for index in torch.arange(len(batch.scores)).split(micro_batch):
        part = batch.rows(index)
        logprobs = policy.evaluate(
            part.input_ids, part.attention_mask, part.completion_length, temperature=temperature
        ).logprobs
        parts.append(torch.nn.functional.pad(logprobs, (0, width - logprobs.shape[1])))
    return torch.cat(parts)


@torch.no_grad()
def offline_metrics(batch: LMBatch, offline_rows: int, policy: LMPolicy, config: Config) -> dict[str, float]:
    """The share of ``batch``'s rows that are offline (its last ``offline_rows``) and their statistics; the
    mean weight is that of the configured off-policy weight on the policy as the update begins."""
    total = len(batch.scores)
    metrics = {"offline/share": offline_rows / total}
    if not offline_rows:
        return metrics
    rows = batch.rows(torch.arange(total - offline_rows, total))
    mask = rows.completion_mask
    weights = None
    if config.estimator.off_policy_weight != "none":  # (none: every weight is 1, no pass needed)
        logprobs = rows.proximal_logprobs  # the learner's pass at the update's start, when it made one
        if logprobs is None:
            logprobs = current_logprobs(
                policy, rows, temperature=config.sample.temperature, micro_batch=config.train.micro_batch_size
            )
        weights = objective.off_policy_weights(config.estimator, logprobs, rows.behaviour_logprobs, mask, age=rows.ages)
    metrics["offline/mean_weight"] = 1.0 if weights is None else float(masked_mean(weights.weights, mask))
    metrics["offline/reward_mean"] = statistics.fmean(rows.scores.tolist())
    if rows.ages is not None:
        metrics["offline/age_mean"] = float(masked_mean(rows.ages, mask))
    return metrics
