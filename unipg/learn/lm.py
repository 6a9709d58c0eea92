"""The learner step for language-model policies: reference log-probs, values and advantages, then epochs of
mini-batch updates of the unified objective (``unipg.learn.objective``).

The batch layout and the advantages live in ``unipg.learn.lm_batch``; every piece of math comes from
``unipg.estimate``. This module runs the policy's forward passes and the optimizer:

- a mini-batch's gradient is accumulated over micro-batches, each weighted so that the sum equals the loss
  of the whole mini-batch under the configured aggregation mode; a micro-batch is ``train.micro_batch_size``
  sequences padded to the longest, or a token budget's worth packed into one row without padding, as
  ``train.max_tokens_per_micro_batch`` decides (``unipg.learn.micro_batches``, ``unipg.policy.packed``);
- bfloat16 weights are stepped through float32 masters (``unipg.learn.precision``); with the policy sharded
  over several processes (``unipg.learn.sharded``) every rank runs this learner on the same batch and takes a
  token-balanced share of each mini-batch's micro-batches;
- the batch moves to the policy's device (``device``) before any pass; metrics come back as Python floats;
- with ``train.tis`` on (``Config.engine_tis_cap``), ``prepare`` recomputes the trainer's log-probs π_trainer_old of
  every sampled token, measures their gap to the engine's on the tokens of the current version (``mismatch/k3``,
  ``mismatch/max_ratio``, ``mismatch/fraction_capped``) and the objective corrects it (``unipg.learn.objective``);
- with ``estimator.ref_sync_steps`` τ, every τ-th update ends by moving the reference copy towards the policy
  (TR-DPO's soft update, ``unipg.estimate.reference_sync``);
- with ``rollback.enabled``, an optimizer step whose loss or gradient norm is not finite is skipped, and with
  ``estimator.target_kl`` also set, an update whose approx KL exceeds ``rollback.kl_multiple × target_kl`` is
  undone; ``unipg.runtime.lm`` counts such tripped updates and rolls back to a checkpoint when they persist;
- with an adapter per role (``agent.role_policy: adapters``), ``prepare`` and ``update`` take each row's role and
  run each micro-batch (of one role) with its role's adapter, stepped and clipped apart (``unipg.learn.role_adapters``).
"""

from __future__ import annotations

import copy
import math

import torch

from unipg.config import Config
from unipg.estimate import ADVANTAGES
from unipg.estimate.kl_control import make_kl_controller
from unipg.estimate.losses import explained_variance, reads_proximal_logprobs
from unipg.estimate.masked import masked_mean, masked_var
from unipg.estimate.reference_sync import soft_update_reference
from unipg.learn import objective
from unipg.learn.common import clip_grad_norm, shuffled_minibatches
from unipg.learn.distributed import process_rank, sum_across_ranks
from unipg.learn.lm_batch import (  # noqa: F401  (LMBatch and the advantage helpers are imported from here too)
    LMBatch,
    episode_ends,
    last_sampled,
    lm_advantages,
    split_across_ranks,
    token_rewards,
    turn_table,
)
from unipg.learn.micro_batches import plan_micro_batches
from unipg.learn.objective import ObjectiveBatch, micro_batch_share, mismatch_metrics  # noqa: F401  (re-exported)
from unipg.learn.precision import Float32Masters
from unipg.learn.role_adapters import RoleAdapters
from unipg.learn.state import (
    generator_state,
    load_optimizer,
    optimizer_tensors,
    restore_generator,
)
from unipg.policy.lm import LMPolicy


class LMLearner:
    """Epochs of mini-batch updates of an ``LMPolicy`` (and its critic) on a ``LMBatch``.

    With ``rollback.enabled`` and ``estimator.target_kl`` set, every update first copies the trainable parameters
    and the optimizer's state, so that an update whose KL spikes can be undone. The copy lives on the parameters'
    device for the length of the update: about three times the trainable parameters' memory with AdamW (the
    parameters and both moment estimates). Without target_kl, or with rollback disabled, nothing is copied.
    """

    def __init__(self, policy: LMPolicy, config: Config):
        self.policy, self.config = policy, config
        train, est = config.train, config.estimator
        critic_lr = train.critic_learning_rate or train.learning_rate
        # low-precision (bfloat16) weights are stepped through float32 masters (unipg.learn.precision)
        self.masters = Float32Masters(policy.actor_parameters() + policy.critic_parameters())
        self.roles = RoleAdapters(policy.model)  # with an adapter per role: a parameter group each
        lr = train.learning_rate
        groups = self.roles.parameter_groups(self.masters.optimized, lr) or [
            {"params": self.masters.optimized(policy.actor_parameters()), "lr": lr, "base_lr": lr}
        ]
        if policy.critic_parameters():
            groups.append(
                {"params": self.masters.optimized(policy.critic_parameters()), "lr": critic_lr, "base_lr": critic_lr}
            )
        self.parameters = [p for group in groups for p in group["params"]]
        # With the policy sharded over a process group (unipg.learn.distributed), every rank runs this learner
        # on the same batch and takes its own share of each mini-batch's micro-batches.
        self.rank, self.world_size = process_rank()
        policy.logits_chunk_tokens = config.model.logits_chunk_tokens
        self.optimizer = torch.optim.AdamW(
            groups,
            eps=train.adam_eps,
            weight_decay=train.weight_decay,
            fused=policy.device.type in ("cpu", "cuda") and self.world_size == 1,
        )
        self.kl_controller = make_kl_controller(
            est.kl_control, coef=est.kl_coef, target_kl=est.target_kl, horizon=est.kl_horizon
        )
        self.generator = torch.Generator().manual_seed(config.seed)
        self.lr_fraction = 1.0
        self.lr_factor = 1.0  # the product of rollback.lr_factor over the run's rollbacks
        rollback = config.rollback
        self.kl_spike = rollback.kl_multiple * est.target_kl if rollback.enabled and est.target_kl else None
        self.tis_cap = config.engine_tis_cap
        self.updates = 0  # calls of ``update`` so far; every estimator.ref_sync_steps of them the reference moves

    @property
    def kl_coef(self) -> float:
        return float(self.kl_controller.coef)

    @torch.no_grad()
    def prepare(self, batch: LMBatch, roles: list[str] | None = None) -> dict[str, float]:
        """Reference log-probs and values under no_grad, then advantages; returns rollout metrics (with tis, the
        engine gap's under their ``mismatch/`` names). Moves ``batch`` to the policy's device. ``roles``: each
        row's role, with an adapter per role."""
        batch.move_to(self.policy.device)
        self.roles.assign(roles)
        groups = self.micro_batches(batch, torch.arange(len(batch.scores)))
        chunks = [batch.rows(index) for index in groups]
        each = lambda pass_of: [self.roles.run(index, pass_of, c) for index, c in zip(groups, chunks)]  # adapter on
        width = batch.completion_length
        # packed micro-batches take rows out of order (balanced by tokens): results go back to their own rows
        order = torch.cat(groups).argsort().to(self.policy.device)

        def padded(tensors: list[torch.Tensor]) -> torch.Tensor:
            """The chunks' (b, c) results as one (B, width) tensor in the batch's row order."""
            return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tensors])[order]

        temperature = self.config.sample.temperature
        stale = batch.ages is not None and bool((batch.ages > 0).any())
        proximal = self.tis_cap is not None or (reads_proximal_logprobs(self.config.estimator.policy_loss) and stale)
        if proximal:
            # π_prox = π_trainer_old, the weights this update starts from; without tis, on fresh data it is taken
            # to be μ, whose log-probs the batch has. The same pass gives the values (a value head's, or the critic's)
            evaluations = each(
                lambda c: self.policy.evaluate(
                    c.input_ids,
                    c.attention_mask,
                    c.completion_length,
                    temperature=temperature,
                    with_values=self.policy.has_critic,
                )
            )
            batch.proximal_logprobs = padded([e.logprobs for e in evaluations]) * batch.completion_mask
            if self.policy.has_critic:
                batch.values = padded([e.values for e in evaluations]) * batch.completion_mask
        if self.policy.has_reference:
            batch.reference_logprobs = padded(each(lambda c: self._chunk_statistic(self.policy.reference_logprobs, c)))
        if "sum_pi_squared" in ADVANTAGES.entry(self.config.estimator.advantage).inputs:
            batch.sum_pi_squared = padded(each(lambda c: self._chunk_statistic(self.policy.sum_pi_squared, c)))
        if self.policy.has_critic and not proximal:
            batch.values = (
                padded(each(lambda c: self.policy.values(c.input_ids, c.attention_mask, c.completion_length)))
                * batch.completion_mask
            )
        batch.advantages, batch.returns = lm_advantages(
            batch, self.config.estimator, group_size=self.config.sample.samples_per_prompt, kl_coef=self.kl_coef
        )
        mask = batch.completion_mask
        metrics = {
            "advantage_mean": float(masked_mean(batch.advantages, mask)),
            "advantage_std": float(masked_var(batch.advantages, mask).sqrt()),
        }
        if batch.values is not None:
            metrics["explained_variance"] = float(explained_variance(batch.values, batch.returns, mask))
            metrics["value_mean"] = float(masked_mean(batch.values, mask))
        if self.tis_cap is not None:
            metrics.update(mismatch_metrics(batch, self.tis_cap))
        return metrics

    def _chunk_statistic(self, statistic, chunk: LMBatch) -> torch.Tensor:
        """A per-token ``statistic`` of the policy (reference log-probs, Σπ²) of a chunk's completions at the sampling
        temperature, (b, c)."""
        return statistic(
            chunk.input_ids,
            chunk.attention_mask,
            chunk.completion_length,
            temperature=self.config.sample.temperature,
        )

    def update(self, batch: LMBatch, roles: list[str] | None = None) -> dict[str, float]:
        """num_epochs passes of shuffled mini-batches; each optimizer step accumulates micro-batches.

        With ``rollback.enabled`` the metrics hold ``skipped_steps``, the optimizer steps skipped for a
        non-finite loss or gradient norm; with target_kl also set, ``reverted`` is 1 when the update's approx KL
        (the mean over its optimizer steps, each measured before the step) was above ``rollback.kl_multiple ×
        target_kl`` or not finite, and the parameters and optimizer state were set back to where the update
        began. A tripped update (a step skipped, or reverted) does not move the KL controller. ``roles``: each
        row's role, with an adapter per role (``role/<role>/grad_norm`` is then each role's).
        """
        train = self.config.train
        batch.move_to(self.policy.device)
        self.roles.assign(roles)
        start = self._snapshot() if self.kl_spike is not None else None
        history: dict[str, list[float]] = {}
        skipped = 0
        rows = torch.arange(len(batch.scores))
        for mini_rows in shuffled_minibatches(
            rows, train.mini_batch_size, epochs=train.num_epochs, generator=self.generator
        ):
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
        self.updates += 1
        sync_steps = self.config.estimator.ref_sync_steps
        if sync_steps is not None and self.updates % sync_steps == 0:
            self.sync_reference()
        return metrics

    def sync_reference(self) -> None:
        """θ_ref ← α θ + (1 − α) θ_ref with α = estimator.ref_sync_alpha (``unipg.estimate.reference_sync``)."""
        reference = self.policy.reference_model
        if reference is None:
            raise ValueError(
                "estimator.ref_sync_steps moves the reference model, and this policy holds no copy of its own (no "
                "reference, or LoRA's adapter-off base weights); set model.reference=copy without LoRA"
            )
        soft_update_reference(
            reference.parameters(), self.policy.model.parameters(), alpha=self.config.estimator.ref_sync_alpha
        )

    def _snapshot(self) -> tuple[list[torch.Tensor], dict]:
        """Copies of the trainable parameters and of the optimizer's state, for ``_revert``."""
        return [p.detach().clone() for p in self.parameters], copy.deepcopy(self.optimizer.state_dict())

    def _revert(self, snapshot: tuple[list[torch.Tensor], dict]) -> None:
        """Set the trainable parameters and the optimizer's state back, bit for bit, to a ``_snapshot``."""
        parameters, optimizer_state = snapshot
        with torch.no_grad():
            for parameter, saved in zip(self.parameters, parameters):
                parameter.copy_(saved)
        self.masters.copy_to_model()
        self.optimizer.load_state_dict(optimizer_state)

    def micro_batches(self, batch: LMBatch, rows: torch.Tensor) -> list[torch.Tensor]:
        """``rows`` of ``batch`` split into micro-batches, padded or packed per ``train.max_tokens_per_micro_batch``
        (``unipg.learn.micro_batches``); sets whether the policy's passes over them pack."""
        configured = self.config.train.max_tokens_per_micro_batch
        share = self.policy.share_prompts and self.policy.shares_packed_prompts()

        def plan_of(rows: torch.Tensor, padded: bool = False):
            max_tokens = None if padded else configured
            return plan_micro_batches(
                batch.input_ids,
                batch.attention_mask,
                batch.completion_length,
                rows,
                micro_batch_size=self.config.train.micro_batch_size,
                max_tokens=max_tokens,
                share_prompts=max_tokens is not None and share,
            )

        plan = self.roles.plan(rows, plan_of)  # with an adapter per role, none mixes roles
        self.policy.packed = plan.packed
        return plan.groups

    def accumulate_gradients(self, batch: LMBatch, mini_rows: torch.Tensor) -> dict[str, float]:
        """Back-propagate a mini-batch's loss over its micro-batches, each weighted by its share, so the
        accumulated gradient is that of the whole mini-batch's loss; returns the mini-batch's metrics."""
        mini_mask = batch.loss_mask(self.config.estimator.mask_truncated_completions)[mini_rows]
        totals: dict[str, float] = {}
        groups = self.micro_batches(batch, mini_rows)
        if self.world_size > 1:
            groups = split_across_ranks(groups, batch.attention_mask.sum(1), self.world_size)[self.rank]
        shortest = mini_rows[batch.attention_mask[mini_rows].sum(1).argmin()][None]  # for a rank's empty pass
        for micro_rows in groups:
            micro = batch.rows(micro_rows if micro_rows is not None else shortest)
            share = (
                micro_batch_share(
                    micro.loss_mask(self.config.estimator.mask_truncated_completions),
                    mini_mask,
                    mode=self.config.estimator.loss_agg_mode,
                    norm_length=self.config.sample.max_new_tokens,
                )
                if micro_rows is not None
                else 0.0
            )
            with self.roles.active(micro_rows if micro_rows is not None else shortest):
                loss, metrics = self._loss(micro)
            (loss * share * self.world_size).backward()  # FSDP averages the gradients of the ranks
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + value * share
        return sum_across_ranks(totals) if self.world_size > 1 else totals

    def _optimizer_step(self, batch: LMBatch, mini_rows: torch.Tensor) -> tuple[dict[str, float], bool]:
        """One optimizer step on a mini-batch; returns its metrics and whether the step was taken (with
        ``rollback.enabled``, a step whose loss or gradient norm is not finite is not: its gradient is dropped)."""
        self.optimizer.zero_grad(set_to_none=True)
        totals = self.accumulate_gradients(batch, mini_rows)
        self.masters.move_gradients()
        if self.roles:  # each role's adapter stepped and clipped apart
            mask = batch.loss_mask(self.config.estimator.mask_truncated_completions)
            totals.update(
                self.roles.clip(self.optimizer.param_groups, mini_rows, mask, self.config.train.max_grad_norm)
            )
        else:
            totals["grad_norm"] = clip_grad_norm(self.parameters, self.config.train.max_grad_norm)
        finite = math.isfinite(totals["loss"]) and math.isfinite(totals["grad_norm"])
        if self.config.rollback.enabled and not finite:
            self.optimizer.zero_grad(set_to_none=True)
            return totals, False
        self.optimizer.step()
        self.masters.copy_to_model()
        return totals, True

    def _loss(self, micro: LMBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """The unified objective of a micro-batch and its metrics."""
        est = self.config.estimator
        out = self.policy.evaluate(
            micro.input_ids,
            micro.attention_mask,
            micro.completion_length,
            temperature=self.config.sample.temperature,
            with_entropy=True,
            entropy_grad=est.entropy_coef > 0,
            with_values=self.policy.has_critic,
        )
        batch = ObjectiveBatch(
            logprobs=out.logprobs,
            behaviour_logprobs=micro.behaviour_logprobs,
            advantages=micro.advantages,
            mask=micro.loss_mask(est.mask_truncated_completions),
            proximal_logprobs=micro.proximal_logprobs,
            age=micro.ages,
            entropy=out.entropy,
            values=out.values,
            old_values=micro.values,
            returns=micro.returns,
            reference_logprobs=micro.reference_logprobs,
        )
        out = objective.unified_objective(
            batch,
            est,
            kl_coef=0.0 if est.kl_in_reward else self.kl_coef,
            report_importance_ess=micro.ages is not None,
            tis_cap=self.tis_cap,
        )
        return out.loss, out.metrics

    def close(self) -> None:
        """Nothing to release in one process (``ShardedLMLearner.close`` stops its processes)."""

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
        self.masters.stash(self.optimizer)
        tensors, optimizer_meta = optimizer_tensors(self.optimizer)
        self.masters.discard(self.optimizer)
        return tensors, self.state(optimizer_meta)

    def state(self, optimizer_meta: dict) -> dict:
        """The JSON part of ``checkpoint``, around the optimizer's metadata."""
        return {
            "optimizer": optimizer_meta,
            "kl_controller": self.kl_controller.state_dict(),
            "generator": generator_state(self.generator),
            "lr_fraction": self.lr_fraction,
            "lr_factor": self.lr_factor,
            "updates": self.updates,
        }

    def restore(self, tensors: dict[str, torch.Tensor], state: dict) -> None:
        """Set the learner back to a state from ``checkpoint``."""
        load_optimizer(self.optimizer, tensors, state["optimizer"])
        self.masters.unstash(self.optimizer)
        self.restore_state(state)

    def restore_state(self, state: dict) -> None:
        """Everything of ``restore`` but the optimizer."""
        self.kl_controller.load_state_dict(state["kl_controller"])
        restore_generator(self.generator, state["generator"])
        self.lr_fraction = state["lr_fraction"]
        self.lr_factor = state["lr_factor"]
        self.updates = state.get("updates", 0)  # absent from checkpoints written before the count was kept
