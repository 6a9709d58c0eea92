"""The learner step for language-model policies: token rewards → advantages → epochs of clipped updates.

Every piece of math comes from ``unipg.estimate``; this module only lays the completions out as (B, C)
token tensors and decides which registered function to call:

- the sequence reward sits on the last sampled token; with ``kl_in_reward`` each token also pays
  −β·KL_t to the reference (classic RLHF PPO, REINFORCE++), otherwise β·KL enters the loss (GRPO);
- group estimators (grpo, dr_grpo, rloo) see one score per completion, in consecutive groups of
  ``samples_per_prompt``; token estimators (gae, reinforce_plus_plus, batch_mean_baseline, ...) see the
  (B, C) token rewards with the episode ending at the last sampled token;
- a mini-batch's gradient is accumulated over micro-batches, each weighted so that the sum equals the loss
  of the whole mini-batch under the configured aggregation mode;
- with ``rollback.enabled``, an optimizer step whose loss or gradient norm is not finite is skipped, and with
  ``estimator.target_kl`` also set, an update whose approx KL exceeds ``rollback.kl_multiple × target_kl`` is
  undone; ``unipg.runtime.lm`` counts such tripped updates and rolls back to a checkpoint when they persist.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from unipg.config import Config
from unipg.estimate import ADVANTAGES, POLICY_LOSSES
from unipg.estimate.advantages import broadcast_to_tokens
from unipg.estimate.kl import kl_penalty
from unipg.estimate.kl_control import make_kl_controller
from unipg.estimate.losses import aggregate, explained_variance, value_loss
from unipg.estimate.masked import (
    masked_mean,
    masked_var,
    masked_whiten,
    pack_masked,
    unpack_masked,
)
from unipg.estimate.weights import weight_metrics
from unipg.learn.gym import (
    clip_grad_norm,
    off_policy_weights,
    shuffled_minibatches,
)
from unipg.learn.state import (
    generator_state,
    load_optimizer,
    optimizer_tensors,
    restore_generator,
)
from unipg.policy.lm import Generation, LMPolicy, left_pad

GROUP_ADVANTAGES = frozenset({"grpo", "dr_grpo", "rloo"})


@dataclass
class TextBatch:
    """B completions; samples of one prompt are consecutive. C = completion length, L = P + C."""

    input_ids: torch.Tensor  # (B, L) left-padded prompt followed by the right-padded completion
    attention_mask: torch.Tensor  # (B, L) 1 on real tokens
    completion_mask: torch.Tensor  # (B, C) 1 on tokens the policy sampled
    behaviour_logprobs: torch.Tensor  # (B, C) log μ(a_t|s_t) at sampling time
    scores: torch.Tensor  # (B,) the sequence reward
    reference_logprobs: torch.Tensor | None = None  # (B, C) log π_ref(a_t|s_t)
    values: torch.Tensor | None = None  # (B, C) V(s_t) before the update
    advantages: torch.Tensor | None = None  # (B, C)
    returns: torch.Tensor | None = None  # (B, C) value-regression targets
    # Multi-turn episodes (None for single-turn completions): K = the most policy turns of any episode.
    token_turns: torch.Tensor | None = None  # (B, C) long, the policy turn of each sampled token, -1 elsewhere
    turn_rewards: torch.Tensor | None = None  # (B, K) reward of each policy turn, 0 past the last
    turn_mask: torch.Tensor | None = None  # (B, K) 1 on turns the episode had
    # Off-policy data (asynchronous training): None when every sample is from the learner's current weights.
    ages: torch.Tensor | None = None  # (B, C) learner version − version that sampled the token, 0 elsewhere
    proximal_logprobs: torch.Tensor | None = None  # (B, C) log π_prox: the weights the update starts from

    @classmethod
    def from_generation(cls, generation: Generation, scores: list[float]) -> "TextBatch":
        return cls(input_ids=torch.cat([generation.prompt_ids, generation.completion_ids], dim=1),
                   attention_mask=torch.cat([generation.prompt_mask, generation.completion_mask], dim=1),
                   completion_mask=generation.completion_mask.float(),
                   behaviour_logprobs=generation.behaviour_logprobs,
                   scores=torch.tensor(scores, dtype=torch.float32))

    @classmethod
    def from_trajectories(cls, trajectories: list, pad_id: int, version: int | None = None) -> "TextBatch":
        """Episodes of the agent loop: the prompt left-padded, every later token right-padded; the loss mask
        (1 on sampled tokens only) is the completion mask. With the learner's ``version``, ``ages`` holds each
        sampled token's age (each turn records the weights version that sampled it)."""
        prompt_ids, prompt_mask = left_pad([t.prompt_ids for t in trajectories], pad_id)
        width = max(max(len(t.token_ids) for t in trajectories), 1)
        turns = max(max(t.turns for t in trajectories), 1)
        batch = len(trajectories)
        ids = torch.full((batch, width), pad_id, dtype=torch.long)
        real, loss_mask, behaviour = (torch.zeros((batch, width), dtype=dtype) for dtype in
                                      (torch.long, torch.float32, torch.float32))
        token_turns = torch.full((batch, width), -1, dtype=torch.long)
        turn_rewards, turn_mask = torch.zeros((batch, turns)), torch.zeros((batch, turns))
        ages = torch.zeros((batch, width)) if version is not None else None
        for row, t in enumerate(trajectories):
            n = len(t.token_ids)
            ids[row, :n] = torch.tensor(t.token_ids, dtype=torch.long)
            real[row, :n] = 1
            loss_mask[row, :n] = torch.tensor(t.loss_mask, dtype=torch.float32)
            behaviour[row, :n] = torch.tensor(t.behaviour_logprobs, dtype=torch.float32)
            token_turns[row, :n] = torch.tensor(t.turn_of_token, dtype=torch.long)
            turn_rewards[row, :t.turns] = torch.tensor(t.step_rewards, dtype=torch.float32)
            turn_mask[row, :t.turns] = 1
            if ages is not None and t.turns:
                turn_ages = torch.tensor([version - v for v in t.policy_versions], dtype=torch.float32)
                ages[row, :n] = turn_ages[token_turns[row, :n].clamp(min=0)] * loss_mask[row, :n]
        return cls(input_ids=torch.cat([prompt_ids, ids], dim=1), attention_mask=torch.cat([prompt_mask, real], dim=1),
                   completion_mask=loss_mask, behaviour_logprobs=behaviour,
                   scores=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
                   token_turns=token_turns, turn_rewards=turn_rewards, turn_mask=turn_mask, ages=ages)

    @property
    def completion_length(self) -> int:
        return self.completion_mask.shape[1]

    def rows(self, index: torch.Tensor) -> "TextBatch":
        """The sub-batch of the given rows in batch order, with all-padding columns on either side dropped.

        Rows are taken in batch order whatever the order of ``index`` (the loss does not depend on it), so a
        micro-batch holding the same rows as a no-grad pass sees exactly the same tensors.
        """
        index = index.sort().values
        fields = {name: (value[index] if isinstance(value, torch.Tensor) else value)
                  for name, value in vars(self).items()}
        sub = TextBatch(**fields)
        first_real = int(sub.attention_mask.argmax(dim=1).min())  # leftmost prompt token of any row
        prompt_width = sub.input_ids.shape[1] - sub.completion_length
        real = sub.attention_mask[:, prompt_width:]  # (b, C) sampled and inserted tokens after the prompt
        keep = max(int((real * torch.arange(1, real.shape[1] + 1)).max()), 1)  # last real column, 1-based
        drop = sub.completion_length - keep
        if first_real > 0 or drop > 0:
            end = sub.input_ids.shape[1] - drop
            sub.input_ids, sub.attention_mask = sub.input_ids[:, first_real:end], sub.attention_mask[:, first_real:end]
            for name in ("completion_mask", "behaviour_logprobs", "reference_logprobs", "values", "advantages", "returns",
                         "token_turns", "ages", "proximal_logprobs"):
                value = getattr(sub, name)
                if value is not None:
                    setattr(sub, name, value[:, :keep])
        assert sub.input_ids.shape[1] == prompt_width - first_real + sub.completion_length
        return sub


def last_sampled(completion_mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of each row's last sampled token (0 for a row without any)."""
    width = completion_mask.shape[1]
    return (width - 1 - completion_mask.flip(1).argmax(1)).clamp(min=0) * (completion_mask.sum(1) > 0)


def token_rewards(batch: TextBatch, kl: torch.Tensor | None, kl_coef: float) -> torch.Tensor:
    """(B, C) rewards: each turn's reward on that turn's last sampled token (single-turn: the sequence score
    on the last sampled token), minus β·KL_t on every sampled token if given."""
    mask = batch.completion_mask
    rewards = torch.zeros_like(mask)
    if batch.turn_rewards is None:
        rewards.scatter_(1, last_sampled(mask)[:, None], batch.scores[:, None].to(rewards.dtype))
        rewards = rewards * (mask.sum(1, keepdim=True) > 0)
    else:
        for turn in range(batch.turn_rewards.shape[1]):
            in_turn = (batch.token_turns == turn).to(mask.dtype)
            has_turn = in_turn.sum(1) > 0
            rows = has_turn.nonzero().flatten()
            rewards[rows, last_sampled(in_turn)[rows]] += batch.turn_rewards[rows, turn]
    if kl is not None:
        rewards = rewards - kl_coef * kl * mask
    return rewards


def episode_ends(completion_mask: torch.Tensor) -> torch.Tensor:
    """(B, C) dones: 1 on the last sampled token, where the episode ends."""
    dones = torch.zeros_like(completion_mask)
    return dones.scatter_(1, last_sampled(completion_mask)[:, None], 1.0)


def text_advantages(batch: TextBatch, config: Config, kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), (B, C), from the configured estimator; 0 on padding and inserted tokens."""
    est, mask = config.estimator, batch.completion_mask
    kl = None
    if est.kl_in_reward and batch.reference_logprobs is not None and kl_coef > 0:
        kl = kl_penalty(batch.behaviour_logprobs, batch.reference_logprobs, estimator=est.kl_estimator)
    rewards = token_rewards(batch, kl, kl_coef)
    group_size = config.sample.samples_per_prompt
    if est.advantage in GROUP_ADVANTAGES:
        per_sequence = ADVANTAGES.call(est.advantage, {"scores": rewards.sum(1), "group_size": group_size}, est)  # (B,)
        advantages = broadcast_to_tokens(per_sequence, mask)
        returns = broadcast_to_tokens(rewards.sum(1), mask)
    elif est.advantage == "turn_level":
        turn_rewards, turn_mask = turn_table(batch, rewards)
        per_turn = ADVANTAGES.call(est.advantage, {"turn_rewards": turn_rewards, "turn_mask": turn_mask,
                                                   "group_size": group_size}, est)
        advantages = per_turn.gather(1, batch.token_turns.clamp(min=0)) * mask if batch.token_turns is not None \
            else broadcast_to_tokens(per_turn[:, 0], mask)
        returns = broadcast_to_tokens(rewards.sum(1), mask)
    else:  # step estimators see the sampled tokens as consecutive steps, inserted tokens removed
        packed_rewards, packed_mask = pack_masked(rewards, mask)
        values = pack_masked(batch.values * mask, mask)[0] if batch.values is not None else None
        data = {"rewards": packed_rewards, "values": values, "dones": episode_ends(packed_mask), "mask": packed_mask,
                "bootstrap_value": None}  # the episode ends on the last sampled token: nothing to bootstrap
        advantages, returns = ADVANTAGES.call(est.advantage, data, est)
        advantages, returns = unpack_masked(advantages, mask), unpack_masked(returns, mask)
    if est.normalize_advantages:
        advantages = masked_whiten(advantages, mask) * mask
    return advantages, returns


def turn_table(batch: TextBatch, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, K) rewards per policy turn (token rewards, KL included, summed within each turn) and turn mask;
    a single-turn batch is one turn per row."""
    if batch.token_turns is None:
        return rewards.sum(1, keepdim=True), (batch.completion_mask.sum(1, keepdim=True) > 0).float()
    turns = batch.turn_rewards.shape[1]
    per_turn = torch.zeros((rewards.shape[0], turns), dtype=rewards.dtype)
    per_turn.scatter_add_(1, batch.token_turns.clamp(min=0), rewards * (batch.token_turns >= 0))
    return per_turn, batch.turn_mask


class TextLearner:
    """Epochs of mini-batch updates of an ``LMPolicy`` (and its critic) on a ``TextBatch``.

    With ``rollback.enabled`` and ``estimator.target_kl`` set, every update first copies the trainable parameters
    and the optimizer's state, so that an update whose KL spikes can be undone. The copy lives on the parameters'
    device for the length of the update: about three times the trainable parameters' memory with AdamW (the
    parameters and both moment estimates). Without target_kl, or with rollback disabled, nothing is copied.
    """

    def __init__(self, policy: LMPolicy, config: Config):
        self.policy, self.config = policy, config
        train, est = config.train, config.estimator
        critic_lr = train.critic_learning_rate or train.learning_rate
        groups = [{"params": policy.actor_parameters(), "lr": train.learning_rate, "base_lr": train.learning_rate}]
        if policy.critic_parameters():
            groups.append({"params": policy.critic_parameters(), "lr": critic_lr, "base_lr": critic_lr})
        self.parameters = [p for group in groups for p in group["params"]]
        self.optimizer = torch.optim.AdamW(groups, eps=train.adam_eps, weight_decay=train.weight_decay,
                                           fused=policy.device.type in ("cpu", "cuda"))
        self.kl_controller = make_kl_controller(est.kl_control, coef=est.kl_coef, target_kl=est.target_kl,
                                                horizon=est.kl_horizon)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.lr_fraction = 1.0
        self.lr_factor = 1.0  # the product of rollback.lr_factor over the run's rollbacks
        rollback = config.rollback
        self.kl_spike = rollback.kl_multiple * est.target_kl if rollback.enabled and est.target_kl else None

    @property
    def kl_coef(self) -> float:
        return float(self.kl_controller.coef)

    @torch.no_grad()
    def prepare(self, batch: TextBatch) -> dict[str, float]:
        """Reference log-probs and values under no_grad, then advantages; returns rollout metrics."""
        micro = self.config.train.micro_batch_size
        chunks = [batch.rows(index) for index in torch.arange(len(batch.scores)).split(micro)]
        width = batch.completion_length

        def padded(tensors: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tensors])

        temperature = self.config.sample.temperature
        stale = batch.ages is not None and bool((batch.ages > 0).any())
        if self.config.estimator.policy_loss == "decoupled_ppo" and stale:
            # π_prox, the weights this update starts from; on fresh data it is μ, whose log-probs the batch has
            batch.proximal_logprobs = padded([self.policy.evaluate(
                c.input_ids, c.attention_mask, c.completion_length, temperature=temperature).logprobs
                for c in chunks]) * batch.completion_mask
        if self.policy.has_reference:
            batch.reference_logprobs = padded([self.policy.reference_logprobs(
                c.input_ids, c.attention_mask, c.completion_length, temperature=temperature) for c in chunks])
        if self.policy.has_critic:
            batch.values = padded([self.policy.values(c.input_ids, c.attention_mask, c.completion_length)
                                   for c in chunks]) * batch.completion_mask
        batch.advantages, batch.returns = text_advantages(batch, self.config, self.kl_coef)
        mask = batch.completion_mask
        metrics = {"advantage_mean": float(masked_mean(batch.advantages, mask)),
                   "advantage_std": float(masked_var(batch.advantages, mask).sqrt())}
        if batch.reference_logprobs is not None:
            kl = kl_penalty(batch.behaviour_logprobs, batch.reference_logprobs, estimator="k3")
            metrics["kl_to_reference"] = float(masked_mean(kl, mask))
        if batch.values is not None:
            metrics["explained_variance"] = float(explained_variance(batch.values, batch.returns, mask))
            metrics["value_mean"] = float(masked_mean(batch.values, mask))
        return metrics

    def update(self, batch: TextBatch) -> dict[str, float]:
        """num_epochs passes of shuffled mini-batches; each optimizer step accumulates micro-batches.

        With ``rollback.enabled`` the metrics hold ``skipped_steps``, the optimizer steps skipped for a
        non-finite loss or gradient norm; with target_kl also set, ``reverted`` is 1 when the update's approx KL
        (the mean over its optimizer steps, each measured before the step) was above ``rollback.kl_multiple ×
        target_kl`` or not finite, and the parameters and optimizer state were set back to where the update
        began. A tripped update (a step skipped, or reverted) does not move the KL controller.
        """
        train = self.config.train
        start = self._snapshot() if self.kl_spike is not None else None
        history: dict[str, list[float]] = {}
        skipped = 0
        rows = torch.arange(len(batch.scores))
        for mini_rows in shuffled_minibatches(rows, train.mini_batch_size, epochs=train.num_epochs,
                                              generator=self.generator):
            step_metrics, stepped = self._optimizer_step(batch, mini_rows)
            skipped += not stepped
            for key, value in step_metrics.items():
                history.setdefault(key, []).append(value)
        metrics = {key: sum(values) / len(values) for key, values in history.items()}
        reverted = start is not None and not metrics["approx_kl"] <= self.kl_spike
        if reverted:
            self._revert(start)
        if "kl_to_reference" in metrics and not (skipped or reverted):
            self.kl_controller.update(metrics["kl_to_reference"], len(batch.scores))
        metrics["kl_coef"] = self.kl_coef
        if self.config.rollback.enabled:
            metrics["skipped_steps"] = float(skipped)
        if start is not None:
            metrics["reverted"] = float(reverted)
        return metrics

    def _snapshot(self) -> tuple[list[torch.Tensor], dict]:
        """Copies of the trainable parameters and of the optimizer's state, for ``_revert``."""
        return [p.detach().clone() for p in self.parameters], copy.deepcopy(self.optimizer.state_dict())

    def _revert(self, snapshot: tuple[list[torch.Tensor], dict]) -> None:
        """Set the trainable parameters and the optimizer's state back, bit for bit, to a ``_snapshot``."""
        parameters, optimizer_state = snapshot
        with torch.no_grad():
            for parameter, saved in zip(self.parameters, parameters):
                parameter.copy_(saved)
        self.optimizer.load_state_dict(optimizer_state)

    def _optimizer_step(self, batch: TextBatch, mini_rows: torch.Tensor) -> tuple[dict[str, float], bool]:
        """One optimizer step on a mini-batch; returns its metrics and whether the step was taken (with
        ``rollback.enabled``, a step whose loss or gradient norm is not finite is not: its gradient is dropped)."""
        mini_mask = batch.completion_mask[mini_rows]
        totals: dict[str, float] = {}
        self.optimizer.zero_grad(set_to_none=True)
        for micro_rows in mini_rows.split(self.config.train.micro_batch_size):
            micro = batch.rows(micro_rows)
            share = self._micro_share(micro.completion_mask, mini_mask)
            loss, metrics = self._loss(micro)
            (loss * share).backward()
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value * share
        totals["grad_norm"] = clip_grad_norm(self.parameters, self.config.train.max_grad_norm)
        finite = math.isfinite(totals["loss"]) and math.isfinite(totals["grad_norm"])
        if self.config.rollback.enabled and not finite:
            self.optimizer.zero_grad(set_to_none=True)
            return totals, False
        self.optimizer.step()
        return totals, True

    def _micro_share(self, micro_mask: torch.Tensor, mini_mask: torch.Tensor) -> float:
        """Weight of a micro-batch's loss so that the weighted sum is the mini-batch's loss."""
        mode = self.config.estimator.loss_agg_mode
        if mode == "token-mean":
            return float(micro_mask.sum() / mini_mask.sum().clamp(min=1))
        if mode == "seq-mean-token-sum-norm":  # Σ / (B · max_new_tokens): a constant normaliser
            return len(micro_mask) / len(mini_mask) * micro_mask.shape[1] / self.config.sample.max_new_tokens
        has_tokens = lambda m: float((m.sum(1) > 0).sum())  # noqa: E731
        return has_tokens(micro_mask) / max(has_tokens(mini_mask), 1.0)

    def _loss(self, micro: TextBatch) -> tuple[torch.Tensor, dict[str, float]]:
        est = self.config.estimator
        mask = micro.completion_mask
        out = self.policy.evaluate(micro.input_ids, micro.attention_mask, micro.completion_length,
                                   temperature=self.config.sample.temperature, with_entropy=True,
                                   entropy_grad=est.entropy_coef > 0,
                                   with_values=self.policy.has_critic)
        weights = off_policy_weights(est, out.logprobs.detach(), micro.behaviour_logprobs, mask, age=micro.ages)
        proximal = micro.proximal_logprobs if micro.proximal_logprobs is not None else micro.behaviour_logprobs
        policy_out = POLICY_LOSSES.call(est.policy_loss, {
            "logprobs": out.logprobs, "behaviour_logprobs": micro.behaviour_logprobs, "proximal_logprobs": proximal,
            "advantages": micro.advantages, "mask": mask, "weights": weights.weights if weights is not None else None},
            est)
        loss = policy_out.loss
        metrics = {"policy_loss": policy_out.loss.item(), **{k: float(v) for k, v in policy_out.metrics.items()}}
        if "approx_kl" not in metrics:
            log_ratio = out.logprobs.detach() - micro.behaviour_logprobs
            metrics["approx_kl"] = float(masked_mean((log_ratio.exp() - 1) - log_ratio, mask))
        if micro.reference_logprobs is not None:
            kl = kl_penalty(out.logprobs, micro.reference_logprobs, estimator=est.kl_estimator)
            kl_mean = aggregate(kl, mask, mode=est.loss_agg_mode)
            if not est.kl_in_reward and self.kl_coef > 0:
                loss = loss + self.kl_coef * kl_mean
            metrics["kl_to_reference"] = float(masked_mean(kl.detach(), mask))
        entropy = aggregate(out.entropy, mask, mode="token-mean")
        if est.entropy_coef > 0:
            loss = loss - est.entropy_coef * entropy
        metrics["entropy"] = entropy.item()
        if out.values is not None:
            critic = value_loss(out.values, micro.returns, mask, old_values=micro.values, clip_range=est.value_clip_range)
            loss = loss + est.value_loss_coef * critic.loss
            metrics["value_loss"] = critic.loss.item()
        if weights is not None:
            metrics.update({f"weights_{k}": float(v) for k, v in weights.metrics.items()})
        if micro.ages is not None:  # effective sample size of the importance weights ρ·w of stale data
            rho = (out.logprobs.detach() - micro.behaviour_logprobs).exp() * mask
            if weights is not None:
                rho = rho * weights.weights
            metrics["importance_ess"] = float(weight_metrics(rho, mask)["ess"])
        metrics["loss"] = loss.item()
        return loss, metrics

    def set_lr_fraction(self, fraction: float) -> float:
        """Scale every group's learning rate to ``fraction`` of its base rate (times ``lr_factor``, lowered by
        rollbacks); returns the policy's rate."""
        self.lr_fraction = fraction
        for group in self.optimizer.param_groups:
            group["lr"] = group["base_lr"] * fraction * self.lr_factor
        return self.optimizer.param_groups[0]["lr"]

    def checkpoint(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The optimizer's tensors, and as JSON the rest of the learner's state: the optimizer's metadata, the
        KL controller, the mini-batch shuffling generator and the learning-rate fraction and factor."""
        tensors, optimizer_meta = optimizer_tensors(self.optimizer)
        return tensors, {"optimizer": optimizer_meta, "kl_controller": self.kl_controller.state_dict(),
                         "generator": generator_state(self.generator), "lr_fraction": self.lr_fraction,
                         "lr_factor": self.lr_factor}

    def restore(self, tensors: dict[str, torch.Tensor], state: dict) -> None:
        """Set the learner back to a state from ``checkpoint``."""
        load_optimizer(self.optimizer, tensors, state["optimizer"])
        self.kl_controller.load_state_dict(state["kl_controller"])
        restore_generator(self.generator, state["generator"])
        self.lr_fraction = state["lr_fraction"]
        self.lr_factor = state["lr_factor"]
