"""The learner step for MLP policies: advantages from the registry, then a gradient or a trust-region update.

Two update rules cover the classic algorithms, and both read their math from ``unipg.estimate``:

- ``GradientLearner``: epochs of shuffled mini-batches; the policy loss is any registered one (``vanilla``
  for REINFORCE and A2C, ``ppo`` for PPO, ``decoupled_ppo``) weighted by the configured off-policy weight;
  the critic's squared error and the entropy bonus are added with their coefficients.
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
from unipg.estimate import ADVANTAGES, OFF_POLICY_WEIGHTS, POLICY_LOSSES
from unipg.estimate.losses import aggregate, value_loss
from unipg.estimate.masked import masked_whiten
from unipg.estimate.trpo import trpo_step
from unipg.policy.mlp import MLPActorCritic
from unipg.sample.gym_rollout import RolloutBatch

# Estimators that need no critic: their returns are Monte-Carlo and cannot be bootstrapped.
MONTE_CARLO_ESTIMATORS = frozenset({"reward_to_go", "batch_mean_baseline"})


def uses_critic(config: Config) -> bool:
    return config.estimator.advantage not in MONTE_CARLO_ESTIMATORS


def bootstraps(config: Config) -> bool:
    """Whether unfinished episodes are completed with the critic's value (else they are masked out)."""
    return uses_critic(config) and config.estimator.advantage != "value_baseline"


def compute_advantages(batch: RolloutBatch, config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), each (N, T), from the configured estimator."""
    data = {"rewards": batch.rewards, "values": batch.values, "dones": batch.dones, "mask": batch.mask,
            "bootstrap_value": batch.bootstrap_value}
    advantages, returns = ADVANTAGES.call(config.estimator.advantage, data, config.estimator)
    return advantages * batch.mask, returns


def flatten_batch(batch: RolloutBatch, advantages: torch.Tensor, returns: torch.Tensor,
                  age: int = 0) -> dict[str, torch.Tensor]:
    """(N, T, ...) → (N·T, ...) samples; the learner treats every step as one sample.

    ``age`` is the learner's version minus the version that collected the segment; every sample carries it.
    """
    n, t = batch.rewards.shape

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(n * t, *x.shape[2:])

    return {"observations": flat(batch.observations), "actions": flat(batch.actions),
            "behaviour_logprobs": flat(batch.behaviour_logprobs), "values": flat(batch.values),
            "mask": flat(batch.mask), "advantages": flat(advantages), "returns": flat(returns),
            "age": torch.full((n * t,), float(age))}


@dataclass
class PreparedSegment:
    """A rollout segment as the learner trains on it: critic values as of now, advantages and flat samples."""

    batch: RolloutBatch
    advantages: torch.Tensor  # (N, T)
    returns: torch.Tensor  # (N, T)
    samples: dict[str, torch.Tensor]  # flat (N·T, ...), for ``update``


def prepare_segment(policy: MLPActorCritic, batch: RolloutBatch, config: Config, *, age: int = 0) -> PreparedSegment:
    """Advantages of a segment collected ``age`` learner versions ago, computed on the learner's side.

    A fresh segment (age 0) keeps the values its rollout recorded, which are the current critic's. A stale
    one has its values V(s_t), its bootstrap value V(s_T) and its time-limit bootstraps re-evaluated with
    the current critic first: the actions stay μ's, but the baseline and the bootstrapped returns should be
    the best estimates available now, not those of a critic ``age`` updates old.
    """
    if age > 0 and uses_critic(config):
        batch = batch.with_values(policy.value, config.estimator.gamma)
    advantages, returns = compute_advantages(batch, config)
    return PreparedSegment(batch, advantages, returns, flatten_batch(batch, advantages, returns, age))


def as_tokens(x: torch.Tensor) -> torch.Tensor:
    """A flat batch of steps (M,) viewed as M one-step sequences (M, 1) for the (B, T) loss functions."""
    return x.unsqueeze(-1)


def shuffled_minibatches(valid: torch.Tensor, size: int, *, epochs: int, generator: torch.Generator):
    """Index tensors of mini-batches over the ``valid`` sample indices, reshuffled every epoch.

    Masked (Monte-Carlo) batches need not divide evenly: the last mini-batch of an epoch may be smaller.
    """
    for _ in range(epochs):
        yield from torch.split(valid[torch.randperm(len(valid), generator=generator)], size)


def off_policy_weights(est, logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
                       age: torch.Tensor | None = None):
    """The configured off-policy weight w(ρ, age) (B, T) of the unified objective, or None for 'none'.

    ``age`` (B,) or (B, T) is the current policy version minus the behaviour version (0 when synchronous).
    """
    if est.off_policy_weight == "none":
        return None
    data = {"logprobs": logprobs, "behaviour_logprobs": behaviour_logprobs, "mask": mask,
            "age": torch.zeros_like(mask) if age is None else age}
    return OFF_POLICY_WEIGHTS.call(est.off_policy_weight, data, est)


def normalized(advantages: torch.Tensor, config: Config) -> torch.Tensor:
    """Advantages whitened over the (mini-)batch when ``estimator.normalize_advantages`` is on."""
    if config.estimator.normalize_advantages and advantages.numel() > 1:
        return masked_whiten(advantages, torch.ones_like(advantages))
    return advantages


class GradientLearner:
    """PPO, A2C and REINFORCE: stochastic gradient steps on policy loss + c_v·value loss − c_e·entropy."""

    def __init__(self, policy: MLPActorCritic, config: Config):
        self.policy, self.config = policy, config
        self.parameters = list(policy.parameters())
        critic_lr = config.train.critic_learning_rate or config.train.learning_rate
        self.optimizer = torch.optim.Adam(
            [{"params": policy.actor_parameters(), "lr": config.train.learning_rate, "base_lr": config.train.learning_rate},
             {"params": policy.critic_parameters(), "lr": critic_lr, "base_lr": critic_lr}],
            eps=config.train.adam_eps, fused=True,
        )
        self.generator = torch.Generator().manual_seed(config.seed)

    def update(self, samples: dict[str, torch.Tensor]) -> dict[str, float]:
        train = self.config.train
        samples = dict(samples, proximal_logprobs=self.proximal_logprobs(samples))
        valid = samples["mask"].nonzero().squeeze(-1)
        history: dict[str, list[float]] = {}
        for index in shuffled_minibatches(valid, train.mini_batch_size, epochs=train.num_epochs,
                                          generator=self.generator):
            metrics = self._step({key: value[index] for key, value in samples.items()})
            for key, value in metrics.items():
                history.setdefault(key, []).append(value)
        return {key: sum(values) / len(values) for key, values in history.items()}

    def proximal_logprobs(self, samples: dict[str, torch.Tensor]) -> torch.Tensor:
        """log π_prox(a|s) of every sample, the anchor of ``decoupled_ppo``'s trust region.

        It is the current policy's, computed once as the batch arrives (before any gradient step), on the
        samples that are stale (age > 0); on fresh samples the current policy is the behaviour policy μ and
        the recorded log μ is used as is. Other losses anchor at μ, so for them this is log μ throughout.
        """
        behaviour = samples["behaviour_logprobs"]
        stale = samples["age"] > 0 if "age" in samples else torch.zeros_like(behaviour, dtype=torch.bool)
        if self.config.estimator.policy_loss != "decoupled_ppo" or not bool(stale.any()):
            return behaviour
        with torch.no_grad():
            current, _, _ = self.policy.evaluate(samples["observations"], samples["actions"])
        return torch.where(stale, current, behaviour)

    def _step(self, mini: dict[str, torch.Tensor]) -> dict[str, float]:
        est, train = self.config.estimator, self.config.train
        logprobs, entropy, values = self.policy.evaluate(mini["observations"], mini["actions"])
        mask = as_tokens(torch.ones_like(logprobs))
        advantages = normalized(mini["advantages"], self.config)
        age = as_tokens(mini["age"]) if "age" in mini else None
        weights = off_policy_weights(est, as_tokens(logprobs.detach()), as_tokens(mini["behaviour_logprobs"]), mask,
                                     age=age)
        policy_out = POLICY_LOSSES.call(est.policy_loss, {
            "logprobs": as_tokens(logprobs), "behaviour_logprobs": as_tokens(mini["behaviour_logprobs"]),
            "proximal_logprobs": as_tokens(mini["proximal_logprobs"]), "advantages": as_tokens(advantages),
            "mask": mask, "weights": weights.weights if weights is not None else None}, est)
        loss = policy_out.loss
        metrics = {"policy_loss": policy_out.loss.item(), **{k: float(v) for k, v in policy_out.metrics.items()}}
        if uses_critic(self.config):
            critic_out = value_loss(as_tokens(values), as_tokens(mini["returns"]), mask,
                                    old_values=as_tokens(mini["values"]), clip_range=est.value_clip_range)
            loss = loss + est.value_loss_coef * critic_out.loss
            metrics["value_loss"] = critic_out.loss.item()
        entropy_mean = aggregate(as_tokens(entropy), mask, mode="token-mean")
        loss = loss - est.entropy_coef * entropy_mean
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = clip_grad_norm(self.parameters, train.max_grad_norm)
        self.optimizer.step()
        if "approx_kl" not in metrics:  # the clipped losses report it; k3 estimate of KL(μ‖π) otherwise
            with torch.no_grad():
                log_ratio = logprobs.detach() - mini["behaviour_logprobs"]
                metrics["approx_kl"] = ((log_ratio.exp() - 1) - log_ratio).mean().item()
        metrics.update(entropy=entropy_mean.item(), grad_norm=grad_norm, loss=loss.item())
        if weights is not None:
            metrics.update({f"weights_{k}": float(v) for k, v in weights.metrics.items()})
        return metrics

    def set_lr_fraction(self, fraction: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = group["base_lr"] * fraction
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])


class TRPOLearner:
    """TRPO: a natural-gradient actor step constrained to mean KL ≤ δ, then Adam epochs on the critic."""

    def __init__(self, policy: MLPActorCritic, config: Config):
        self.policy, self.config = policy, config
        critic_lr = config.train.critic_learning_rate or config.train.learning_rate
        self.base_lr = critic_lr
        self.critic_optimizer = torch.optim.Adam(policy.critic_parameters(), lr=critic_lr,
                                                 eps=config.train.adam_eps, fused=True)
        self.generator = torch.Generator().manual_seed(config.seed)

    def update(self, samples: dict[str, torch.Tensor]) -> dict[str, float]:
        est = self.config.estimator
        valid = samples["mask"].nonzero().squeeze(-1)
        observations, actions = samples["observations"][valid], samples["actions"][valid]
        advantages = normalized(samples["advantages"][valid], self.config)
        with torch.no_grad():
            old_dist = self.policy.distribution(observations)
            old_logprobs = old_dist.log_prob(actions)

        def surrogate() -> torch.Tensor:  # L(θ) = E[π_θ/π_old · A], to maximise
            return (torch.exp(self.policy.distribution(observations).log_prob(actions) - old_logprobs) * advantages).mean()

        def mean_kl() -> torch.Tensor:  # E_s[KL(π_old(·|s) ‖ π_θ(·|s))], old detached
            return kl_divergence(old_dist, self.policy.distribution(observations)).mean()

        result = trpo_step(self.policy.actor_parameters(), surrogate, mean_kl, max_kl=est.max_kl,
                           damping=est.cg_damping, cg_iterations=est.cg_iterations,
                           backtrack_coef=est.backtrack_coef, max_backtracks=est.line_search_steps)
        with torch.no_grad():
            entropy = self.policy.distribution(observations).entropy().mean().item()
        # approx_kl is the exact mean KL(π_old‖π_new) here, named as in the other learners.
        metrics = {"approx_kl": result.kl, "step_accepted": float(result.accepted), "step_fraction": result.step_fraction,
                   "surrogate_improvement": result.surrogate_improvement, "line_search_steps": result.line_search_steps,
                   "entropy": entropy}
        metrics.update(self._fit_critic(samples, valid))
        return metrics

    def _fit_critic(self, samples: dict[str, torch.Tensor], valid: torch.Tensor) -> dict[str, float]:
        train = self.config.train
        losses, grad_norms = [], []
        for index in shuffled_minibatches(valid, train.mini_batch_size, epochs=train.critic_updates,
                                          generator=self.generator):
            values = self.policy.value(samples["observations"][index])
            out = value_loss(as_tokens(values), as_tokens(samples["returns"][index]), as_tokens(torch.ones_like(values)))
            self.critic_optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            grad_norms.append(clip_grad_norm(self.policy.critic_parameters(), train.max_grad_norm))
            self.critic_optimizer.step()
            losses.append(out.loss.item())
        return {"value_loss": sum(losses) / len(losses), "grad_norm": sum(grad_norms) / len(grad_norms)}

    def set_lr_fraction(self, fraction: float) -> float:
        for group in self.critic_optimizer.param_groups:
            group["lr"] = self.base_lr * fraction
        return self.base_lr * fraction

    def state_dict(self) -> dict:
        return {"optimizer": self.critic_optimizer.state_dict(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.critic_optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])


def clip_grad_norm(parameters: list[torch.Tensor], max_norm: float | None) -> float:
    """Clip the global gradient norm to ``max_norm`` (None: only measure it); returns the pre-clip norm."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    if max_norm is not None:
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return float(norm)


def make_learner(policy: MLPActorCritic, config: Config):
    if config.estimator.policy_loss == "trpo":
        return TRPOLearner(policy, config)
    return GradientLearner(policy, config)
