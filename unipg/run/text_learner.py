"""The learner step for language-model policies: token rewards → advantages → epochs of clipped updates.

Every piece of math comes from ``unipg.estimate``; this module only lays the completions out as (B, C)
token tensors and decides which registered function to call:

- the sequence reward sits on the last sampled token; with ``kl_in_reward`` each token also pays
  −β·KL_t to the reference (classic RLHF PPO, REINFORCE++), otherwise β·KL enters the loss (GRPO);
- group estimators (grpo, dr_grpo, rloo) see one score per completion, in consecutive groups of
  ``samples_per_prompt``; token estimators (gae, reinforce_plus_plus, batch_mean_baseline, ...) see the
  (B, C) token rewards with the episode ending at the last sampled token;
- a mini-batch's gradient is accumulated over micro-batches, each weighted so that the sum equals the loss
  of the whole mini-batch under the configured aggregation mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unipg.config import Config
from unipg.estimate import ADVANTAGES, POLICY_LOSSES
from unipg.estimate.advantages import broadcast_to_tokens
from unipg.estimate.kl import kl_penalty
from unipg.estimate.kl_control import make_kl_controller
from unipg.estimate.losses import aggregate, explained_variance, value_loss
from unipg.estimate.masked import masked_mean, masked_var, masked_whiten
from unipg.policy.lm import Generation, LMPolicy
from unipg.run.learner import call_with_available, clip_grad_norm, off_policy_weights, shuffled_minibatches

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

    @classmethod
    def from_generation(cls, generation: Generation, scores: list[float]) -> "TextBatch":
        return cls(input_ids=torch.cat([generation.prompt_ids, generation.completion_ids], dim=1),
                   attention_mask=torch.cat([generation.prompt_mask, generation.completion_mask], dim=1),
                   completion_mask=generation.completion_mask.float(),
                   behaviour_logprobs=generation.behaviour_logprobs,
                   scores=torch.tensor(scores, dtype=torch.float32))

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
        keep = max(int(sub.completion_mask.sum(1).max()), 1)  # longest completion in these rows
        drop = sub.completion_length - keep
        if first_real > 0 or drop > 0:
            end = sub.input_ids.shape[1] - drop
            sub.input_ids, sub.attention_mask = sub.input_ids[:, first_real:end], sub.attention_mask[:, first_real:end]
            for name in ("completion_mask", "behaviour_logprobs", "reference_logprobs", "values", "advantages", "returns"):
                value = getattr(sub, name)
                if value is not None:
                    setattr(sub, name, value[:, :keep])
        assert sub.input_ids.shape[1] == prompt_width - first_real + sub.completion_length
        return sub


def token_rewards(scores: torch.Tensor, completion_mask: torch.Tensor, kl: torch.Tensor | None,
                  kl_coef: float) -> torch.Tensor:
    """(B, C) rewards: the sequence score on the last sampled token, minus β·KL_t on every token if given."""
    rewards = torch.zeros_like(completion_mask)
    last = (completion_mask.sum(1).long() - 1).clamp(min=0)  # (B,) index of the last sampled token
    rewards.scatter_(1, last[:, None], scores[:, None].to(rewards.dtype))
    rewards = rewards * (completion_mask.sum(1, keepdim=True) > 0)
    if kl is not None:
        rewards = rewards - kl_coef * kl * completion_mask
    return rewards


def episode_ends(completion_mask: torch.Tensor) -> torch.Tensor:
    """(B, C) dones: 1 on the last sampled token, where the episode (the completion) ends."""
    dones = torch.zeros_like(completion_mask)
    last = (completion_mask.sum(1).long() - 1).clamp(min=0)
    return dones.scatter_(1, last[:, None], 1.0)


def text_advantages(batch: TextBatch, config: Config, kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), (B, C), from the configured estimator; 0 on padding."""
    est, mask = config.estimator, batch.completion_mask
    kl = None
    if est.kl_in_reward and batch.reference_logprobs is not None and kl_coef > 0:
        kl = kl_penalty(batch.behaviour_logprobs, batch.reference_logprobs, estimator=est.kl_estimator)
    rewards = token_rewards(batch.scores, mask, kl, kl_coef)
    estimator = ADVANTAGES.get(est.advantage)
    if est.advantage in GROUP_ADVANTAGES:
        per_sequence = estimator(rewards.sum(1), group_size=config.sample.samples_per_prompt)  # (B,)
        advantages = broadcast_to_tokens(per_sequence, mask)
        returns = broadcast_to_tokens(rewards.sum(1), mask)
    else:
        values = batch.values * mask if batch.values is not None else None
        advantages, returns = call_with_available(
            estimator, rewards=rewards, values=values, dones=episode_ends(mask), mask=mask,
            gamma=est.gamma, lam=est.lambda_gae)
        advantages, returns = advantages * mask, returns * mask
    if est.normalize_advantages:
        advantages = masked_whiten(advantages, mask) * mask
    return advantages, returns


class TextLearner:
    """Epochs of mini-batch updates of an ``LMPolicy`` (and its critic) on a ``TextBatch``."""

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
        """num_epochs passes of shuffled mini-batches; each optimizer step accumulates micro-batches."""
        train = self.config.train
        history: dict[str, list[float]] = {}
        rows = torch.arange(len(batch.scores))
        for mini_rows in shuffled_minibatches(rows, train.mini_batch_size, epochs=train.num_epochs,
                                              generator=self.generator):
            for key, value in self._optimizer_step(batch, mini_rows).items():
                history.setdefault(key, []).append(value)
        if "kl_to_reference" in history:
            self.kl_controller.update(sum(history["kl_to_reference"]) / len(history["kl_to_reference"]),
                                      len(batch.scores))
        metrics = {key: sum(values) / len(values) for key, values in history.items()}
        metrics["kl_coef"] = self.kl_coef
        return metrics

    def _optimizer_step(self, batch: TextBatch, mini_rows: torch.Tensor) -> dict[str, float]:
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
        self.optimizer.step()
        return totals

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
        weights = off_policy_weights(est, out.logprobs.detach(), micro.behaviour_logprobs, mask)
        policy_out = call_with_available(
            POLICY_LOSSES.get(est.policy_loss), logprobs=out.logprobs, behaviour_logprobs=micro.behaviour_logprobs,
            proximal_logprobs=micro.behaviour_logprobs, advantages=micro.advantages, mask=mask,
            clip_low=est.clip_range, clip_high=est.clip_range_high, dual_clip=est.dual_clip,
            agg_mode=est.loss_agg_mode, weights=weights.weights if weights is not None else None)
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
        metrics["loss"] = loss.item()
        return loss, metrics

    def set_lr_fraction(self, fraction: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = group["base_lr"] * fraction
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "generator": self.generator.get_state(),
                "kl_controller": self.kl_controller.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        self.kl_controller.load_state_dict(state["kl_controller"])
