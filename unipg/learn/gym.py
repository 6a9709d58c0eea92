"""The learner step for MLP policies: advantages from the registry, then a gradient or a trust-region update.

Two update rules cover the classic algorithms, and both read their math from ``unipg.estimate``:

- ``GradientLearner``: epochs of shuffled mini-batches of the unified objective (``unipg.learn.objective``,
  shared with the language-model learner, each step one-token sequence): the policy loss is any registered
  one (``vanilla`` for REINFORCE and A2C, ``ppo`` for PPO, ``decoupled_ppo``) weighted by the configured
  off-policy weight; the critic's squared error and the entropy bonus are added with their coefficients.
- ``TRPOLearner``: one natural-gradient step for the actor in a KL trust region, then critic regression.

Segments may arrive some learner versions after they were collected (``runtime.max_staleness`` > 0).
``prepare_segment`` then re-evaluates the critic's values before computing advantages, every sample carries
its age for the age-aware off-policy weights, and ``decoupled_ppo`` anchors its trust region at the current
policy (``GradientLearner.proximal_logprobs``). TRPO's trust region is always around the current policy; it
applies no correction for the behaviour policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributions import kl_divergence

from unipg.config import Config
from unipg.config.schema import EstimatorConfig
from unipg.estimate import ADVANTAGES, needs_critic
from unipg.estimate.losses import reads_proximal_logprobs, value_loss
from unipg.estimate.trpo import TRUST_REGION_STEPS
from unipg.learn import mlp_gradient, objective
from unipg.learn.common import clip_grad_norm, shuffled_minibatches
from unipg.learn.flat_adam import FlatAdam, merge_per_parameter_state
from unipg.learn.objective import ObjectiveBatch, as_tokens
from unipg.learn.state import (
    generator_state,
    load_optimizer,
    optimizer_tensors,
    restore_generator,
)
from unipg.policy.mlp import MLPActorCritic
from unipg.sample.gym_rollout import RolloutBatch


def uses_critic(estimator: EstimatorConfig) -> bool:
    """Whether the estimator reads V(s_t); the others' returns are Monte-Carlo and cannot be bootstrapped."""
    return needs_critic(estimator.advantage)


def bootstraps(estimator: EstimatorConfig) -> bool:
    """Whether unfinished episodes are completed with the critic's value (else they are masked out)."""
    return uses_critic(estimator) and estimator.advantage != "value_baseline"


def compute_advantages(batch: RolloutBatch, estimator: EstimatorConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), each (N, T), from the configured estimator."""
    data = {
        "rewards": batch.rewards,
        "values": batch.values,
        "dones": batch.dones,
        "mask": batch.mask,
        "bootstrap_value": batch.bootstrap_value,
    }
    advantages, returns = ADVANTAGES.call(estimator.advantage, data, estimator)
    return advantages * batch.mask, returns


def flatten_batch(
    batch: RolloutBatch, advantages: torch.Tensor, returns: torch.Tensor, age: int = 0
) -> dict[str, torch.Tensor]:
    """(N, T, ...) → (N·T, ...) samples; the learner treats every step as one sample.

    ``age`` is the learner's version minus the version that collected the segment; every sample carries it.
    """
    n, t = batch.rewards.shape

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(n * t, *x.shape[2:])

    return {
        "observations": flat(batch.observations),
        "actions": flat(batch.actions),
        "behaviour_logprobs": flat(batch.behaviour_logprobs),
        "values": flat(batch.values),
        "mask": flat(batch.mask),
        "advantages": flat(advantages),
        "returns": flat(returns),
        "age": torch.full((n * t,), float(age)),
    }


@dataclass
class PreparedSegment:
    """A rollout segment as the learner trains on it: critic values as of now, advantages and flat samples."""

    batch: RolloutBatch
    advantages: torch.Tensor  # (N, T)
    returns: torch.Tensor  # (N, T)
    samples: dict[str, torch.Tensor]  # flat (N·T, ...), for ``update``


def prepare_segment(
    policy: MLPActorCritic, batch: RolloutBatch, estimator: EstimatorConfig, *, age: int = 0
) -> PreparedSegment:
    """Advantages of a segment collected ``age`` learner versions ago, computed on the learner's side.

    A fresh segment (age 0) keeps the values its rollout recorded, which are the current critic's. A stale
    one has its values V(s_t), its bootstrap value V(s_T) and its time-limit bootstraps re-evaluated with
    the current critic first: the actions stay μ's, but the baseline and the bootstrapped returns should be
    the best estimates available now, not those of a critic ``age`` updates old.
    """
    if age > 0 and uses_critic(estimator):
        batch = batch.with_values(policy.value, estimator.gamma)
    advantages, returns = compute_advantages(batch, estimator)
    return PreparedSegment(batch, advantages, returns, flatten_batch(batch, advantages, returns, age))


def normalized(advantages: torch.Tensor, estimator: EstimatorConfig) -> torch.Tensor:
    """Advantages whitened over the (mini-)batch when ``estimator.normalize_advantages`` is on: (A − mean) / (std + ε),
    ``masked_whiten`` with every sample valid, in the three operations it then comes down to."""
    if estimator.normalize_advantages and advantages.numel() > 1:
        std, mean = torch.std_mean(advantages)  # std Bessel-corrected, as masked_whiten's
        return (advantages - mean) / (std + 1e-8)
    return advantages


def read_fields(samples: dict[str, torch.Tensor], estimator: EstimatorConfig) -> dict[str, torch.Tensor]:
    """The sample fields the objective reads under ``estimator``: the age only for an off-policy weight (the
    gymnasium learner has no engine gap to correct), V at rollout time only for value clipping."""
    unread = set()
    if estimator.off_policy_weight == "none":
        unread.add("age")
    if estimator.value_clip_range is None:
        unread.add("values")
    return {key: value for key, value in samples.items() if key not in unread}


def epoch_minibatches(
    samples: dict[str, torch.Tensor], valid: torch.Tensor, size: int, epochs: int, generator: torch.Generator
):
    """The mini-batches of ``shuffled_minibatches`` over ``samples``' fields: each field is gathered in the epoch's
    order once per epoch and then sliced, rather than gathered once per mini-batch (same samples, same order)."""
    for _ in range(epochs if len(valid) else 0):
        (order,) = shuffled_minibatches(valid, len(valid), epochs=1, generator=generator)
        shuffled = {key: value.index_select(0, order) for key, value in samples.items()}
        parts = {key: value.split(size) for key, value in shuffled.items()}
        yield from (dict(zip(parts, mini)) for mini in zip(*parts.values()))


class LearnerState:
    """What a gym learner's checkpoint holds: its optimizer (``_optimizer``) and its mini-batch generator."""

    generator: torch.Generator

    @property
    def _optimizer(self) -> torch.optim.Optimizer:
        raise NotImplementedError

    def checkpoint(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(optimizer tensors, JSON state) for a checkpoint: the optimizer and the mini-batch generator."""
        tensors, meta = optimizer_tensors(self._optimizer)
        return tensors, {"optimizer": meta, "generator": generator_state(self.generator)}

    def restore(self, tensors: dict[str, torch.Tensor], state: dict) -> None:
        """Continue from ``checkpoint``'s output."""
        load_optimizer(self._optimizer, tensors, state["optimizer"])
        restore_generator(self.generator, state["generator"])


class GradientLearner(LearnerState):
    """PPO, A2C and REINFORCE: stochastic gradient steps on policy loss + c_v·value loss − c_e·entropy."""

    def __init__(self, policy: MLPActorCritic, config: Config):
        self.policy, self.config = policy, config
        critic_lr = config.train.critic_learning_rate or config.train.learning_rate
        # the actor's and the critic's parameters each become views of one flat tensor (unipg.learn.flat_adam)
        self.adam = FlatAdam(
            [(policy.actor_parameters(), config.train.learning_rate), (policy.critic_parameters(), critic_lr)],
            eps=config.train.adam_eps,
        )
        self.optimizer = self.adam.optimizer
        self.generator = torch.Generator().manual_seed(config.seed)
        # the network's gradient written by hand where it applies (unipg.learn.mlp_gradient), else autograd's
        self.hand_gradient = mlp_gradient.applies(policy, config.estimator)

    def update(self, samples: dict[str, torch.Tensor]) -> dict[str, float]:
        train = self.config.train
        samples = dict(samples)
        valid = samples.pop("mask").nonzero().squeeze(-1)  # mini-batches draw valid samples only: no mask after
        proximal = self.proximal_logprobs(samples)
        if proximal is not samples["behaviour_logprobs"]:  # else π_prox = μ, which the objective reads as None
            samples["proximal_logprobs"] = proximal
        samples = read_fields(samples, self.config.estimator)
        history: dict[str, list[torch.Tensor]] = {}
        for mini in epoch_minibatches(samples, valid, train.mini_batch_transitions, train.num_epochs, self.generator):
            metrics = self._step(mini)
            for key, value in metrics.items():
                history.setdefault(key, []).append(value)
        if not history:  # no valid sample: no step was taken
            return {}
        # each metric's mean over the mini-batch steps, read once per update rather than once per step
        means = torch.stack([torch.stack(values) for values in history.values()]).double().mean(dim=1)
        return dict(zip(history, means.tolist()))

    def proximal_logprobs(self, samples: dict[str, torch.Tensor]) -> torch.Tensor:
        """log π_prox(a|s) of every sample, the anchor of ``decoupled_ppo``'s trust region.

        It is the current policy's, computed once as the batch arrives (before any gradient step), on the
        samples that are stale (age > 0); on fresh samples the current policy is the behaviour policy μ and
        the recorded log μ is used as is. Other losses anchor at μ, so for them this is log μ throughout.
        """
        behaviour = samples["behaviour_logprobs"]
        stale = samples["age"] > 0 if "age" in samples else torch.zeros_like(behaviour, dtype=torch.bool)
        if not reads_proximal_logprobs(self.config.estimator.policy_loss) or not bool(stale.any()):
            return behaviour
        with torch.no_grad():
            current, _, _ = self.policy.evaluate(samples["observations"], samples["actions"])
        return torch.where(stale, current, behaviour)

    def _step(self, mini: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One gradient step on a mini-batch of flat samples: the unified objective, viewed as (M, 1) tokens.
        Returns its metrics and the gradient norm before clipping, each a detached 0-d tensor."""
        if self.hand_gradient:
            logprobs, entropy, values, saved = mlp_gradient.evaluate(self.policy, mini["observations"], mini["actions"])
        else:
            logprobs, entropy, values = self.policy.evaluate(
                mini["observations"], mini["actions"], entropy_grad=self.config.estimator.entropy_coef > 0
            )
        critic = uses_critic(self.config.estimator)
        batch = ObjectiveBatch.from_steps(
            logprobs=logprobs,
            behaviour_logprobs=mini["behaviour_logprobs"],
            proximal_logprobs=mini.get("proximal_logprobs"),
            advantages=normalized(mini["advantages"], self.config.estimator),
            age=mini.get("age"),
            entropy=entropy,
            values=values if critic else None,
            old_values=mini.get("values") if critic else None,
            returns=mini["returns"] if critic else None,
        )
        out = objective.unified_objective(batch, self.config.estimator, tensor_metrics=True)
        if self.hand_gradient:
            mlp_gradient.backward(self.policy, saved, out.loss, batch, self.config.estimator)
        else:
            self.adam.zero_grad()
            out.loss.backward()
        grad_norm = self.adam.clip_grad_norm(self.config.train.max_grad_norm)
        self.adam.step()
        return {**out.metrics, "grad_norm": grad_norm}

    @property
    def _optimizer(self) -> torch.optim.Optimizer:
        return self.optimizer

    def restore(self, tensors: dict[str, torch.Tensor], state: dict) -> None:
        """``LearnerState.restore``, also from checkpoints written with one Adam state per parameter tensor."""
        tensors, optimizer = merge_per_parameter_state(tensors, state["optimizer"])
        super().restore(tensors, {**state, "optimizer": optimizer})

    def set_lr_fraction(self, fraction: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = group["base_lr"] * fraction
        return self.optimizer.param_groups[0]["lr"]


class TRPOLearner(LearnerState):
    """TRPO: a natural-gradient actor step constrained to mean KL ≤ δ, then Adam epochs on the critic."""

    def __init__(self, policy: MLPActorCritic, config: Config):
        self.policy, self.config = policy, config
        critic_lr = config.train.critic_learning_rate or config.train.learning_rate
        self.base_lr = critic_lr
        self.critic_optimizer = torch.optim.Adam(
            policy.critic_parameters(), lr=critic_lr, eps=config.train.adam_eps, fused=True
        )
        self.generator = torch.Generator().manual_seed(config.seed)

    def update(self, samples: dict[str, torch.Tensor]) -> dict[str, float]:
        est = self.config.estimator
        valid = samples["mask"].nonzero().squeeze(-1)
        observations, actions = samples["observations"][valid], samples["actions"][valid]
        advantages = normalized(samples["advantages"][valid], self.config.estimator)
        with torch.no_grad():
            old_dist = self.policy.distribution(observations)
            old_logprobs = old_dist.log_prob(actions)

        def surrogate() -> torch.Tensor:  # L(θ) = E[π_θ/π_old · A], to maximise
            return (
                torch.exp(self.policy.distribution(observations).log_prob(actions) - old_logprobs) * advantages
            ).mean()

        def mean_kl() -> torch.Tensor:  # E_s[KL(π_old(·|s) ‖ π_θ(·|s))], old detached
            return kl_divergence(old_dist, self.policy.distribution(observations)).mean()

        result = TRUST_REGION_STEPS.call(
            est.policy_loss,
            {"params": self.policy.actor_parameters(), "surrogate_fn": surrogate, "kl_fn": mean_kl},
            est,
        )
        with torch.no_grad():
            entropy = self.policy.distribution(observations).entropy().mean().item()
        # approx_kl is the exact mean KL(π_old‖π_new) here, named as in the other learners.
        metrics = {
            "approx_kl": result.kl,
            "step_accepted": float(result.accepted),
            "step_fraction": result.step_fraction,
            "surrogate_improvement": result.surrogate_improvement,
            "line_search_steps": result.line_search_steps,
            "entropy": entropy,
        }
        metrics.update(self._fit_critic(samples, valid))
        return metrics

    def _fit_critic(self, samples: dict[str, torch.Tensor], valid: torch.Tensor) -> dict[str, float]:
        train = self.config.train
        losses, grad_norms = [], []
        for index in shuffled_minibatches(
            valid, train.mini_batch_transitions, epochs=train.critic_updates, generator=self.generator
        ):
            values = self.policy.value(samples["observations"][index])
            out = value_loss(
                as_tokens(values), as_tokens(samples["returns"][index]), as_tokens(torch.ones_like(values))
            )
            self.critic_optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            grad_norms.append(clip_grad_norm(self.policy.critic_parameters(), train.max_grad_norm))
            self.critic_optimizer.step()
            losses.append(out.loss.item())
        return {"value_loss": sum(losses) / len(losses), "grad_norm": sum(grad_norms) / len(grad_norms)}

    @property
    def _optimizer(self) -> torch.optim.Optimizer:
        return self.critic_optimizer

    def set_lr_fraction(self, fraction: float) -> float:
        for group in self.critic_optimizer.param_groups:
            group["lr"] = self.base_lr * fraction
        return self.base_lr * fraction


def make_learner(policy: MLPActorCritic, config: Config):
    if config.estimator.policy_loss == "trpo":
        return TRPOLearner(policy, config)
    return GradientLearner(policy, config)
