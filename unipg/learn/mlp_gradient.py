"""The gradient of a discrete MLP actor-critic written by hand: the gymnasium learner's fast path.

On a 64-64 MLP and mini-batches of 64 samples, each torch operation costs more in dispatch than in arithmetic,
and autograd adds its own graph bookkeeping to every one. For the common case (a categorical policy whose
entropy carries no gradient) the network's part of the gradient is a handful of matrix products:

- ``evaluate`` runs actor and critic without recording a graph, keeping each linear layer's input, and returns
  log π(a|s) and V(s) as leaf tensors that require a gradient (the entropy detached);
- the objective (``unipg.learn.objective``, unchanged) is computed on those leaves as usual, for its loss and
  metrics; ∂loss/∂log π(a|s) and ∂loss/∂V(s) come from ``objective_gradient`` for plain PPO-clip with the value
  loss (the per-sample coefficient from the clip rule in ``unipg.estimate.losses.ppo_clip_coefficient``), and
  from autograd on that small graph for any other configured loss;
- ``backward`` carries these through the two networks by hand and writes each parameter's ``grad`` in place:
  ∂/∂logits = g · (onehot(a) − softmax), then per layer ∂W = δᵀ·input, ∂b = Σδ, δ ← (δ·W) ⊙ act'(output).

The result is autograd's gradient (tests/learn/test_mlp_gradient.py compares both). ``applies`` says when the
fast path holds; everything else (continuous actions, an entropy bonus) goes through autograd.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from unipg.config.schema import EstimatorConfig
from unipg.estimate.losses import ppo_clip_coefficient
from unipg.learn.objective import ObjectiveBatch
from unipg.policy.mlp import MLPActorCritic

# each activation's derivative from its output y = act(x)
_DERIVATIVE_FROM_OUTPUT = {
    nn.Tanh: lambda y: 1 - y * y,
    nn.ReLU: lambda y: (y > 0).to(y.dtype),
}


def applies(policy: MLPActorCritic, estimator: EstimatorConfig) -> bool:
    """Whether ``GradientLearner`` may use the hand-written gradient: a categorical policy, MLPs of supported
    activations, and no entropy bonus (the entropy is then only reported)."""
    activations = [
        type(layer) for net in (policy.actor, policy.critic) for layer in net if not isinstance(layer, nn.Linear)
    ]
    return policy.discrete and estimator.entropy_coef == 0 and all(a in _DERIVATIVE_FROM_OUTPUT for a in activations)


@dataclass
class SavedForward:
    """What ``backward`` needs from ``evaluate``: the leaves, each network's linear-layer inputs, π(·|s), a."""

    logprobs: torch.Tensor  # (M,) leaf, requires grad
    values: torch.Tensor  # (M,) leaf, requires grad
    actor_inputs: list[torch.Tensor]
    critic_inputs: list[torch.Tensor]
    probs: torch.Tensor  # (M, n_actions)
    actions: torch.Tensor  # (M, 1) int64


def _forward(network: nn.Sequential, inputs: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``run_mlp(network, inputs)`` and the input of each linear layer, in order."""
    saved = []
    for layer in network:
        if isinstance(layer, nn.Linear):
            saved.append(inputs)
            inputs = torch.addmm(layer.bias, inputs, layer.weight.t())
        else:
            inputs = torch.tanh(inputs) if isinstance(layer, nn.Tanh) else torch.relu(inputs)
    return inputs, saved


@torch.no_grad()
def evaluate(
    policy: MLPActorCritic, observations: torch.Tensor, actions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, SavedForward]:
    """(log π_θ(a|s), entropy, V_φ(s), saved) as ``MLPActorCritic.evaluate(..., entropy_grad=False)``, with
    log π and V leaves that require a gradient: the objective's graph starts at them."""
    logits, actor_inputs = _forward(policy.actor, observations)
    values, critic_inputs = _forward(policy.critic, observations)
    logprobs_all = torch.log_softmax(logits, dim=-1)
    probs = logprobs_all.exp()
    index = actions.long().unsqueeze(-1)
    logprobs = logprobs_all.gather(-1, index).squeeze(-1).requires_grad_()
    entropy = -(probs * logprobs_all).sum(-1)
    values = values.squeeze(-1).requires_grad_()
    return logprobs, entropy, values, SavedForward(logprobs, values, actor_inputs, critic_inputs, probs, index)


def objective_by_hand(estimator: EstimatorConfig, batch: ObjectiveBatch) -> bool:
    """Whether ``objective_gradient`` gives the objective's gradient: plain PPO-clip (token mean, every sample
    valid, no dual clip, no off-policy weight, no entropy selection) plus the unclipped value loss, nothing else."""
    return (
        estimator.policy_loss == "ppo"
        and estimator.off_policy_weight == "none"
        and estimator.dual_clip is None
        and estimator.loss_agg_mode == "token-mean"
        and estimator.top_entropy_quantile >= 1.0
        and estimator.value_clip_range is None
        and estimator.entropy_coef == 0
        and batch.every_token_valid
        and batch.values is not None
        and batch.reference_logprobs is None
        and batch.proximal_logprobs is None
    )


def objective_gradient(estimator: EstimatorConfig, batch: ObjectiveBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(∂loss/∂log π, ∂loss/∂V), each (M,), of the loss ``objective_by_hand`` accepts: −coefficient/M from the PPO
    clip rule (``ppo_clip_coefficient``) and value_loss_coef·(V − R)/M from ½ (V − R)²."""
    count = batch.logprobs.numel()
    clip_high = estimator.clip_range if estimator.clip_range_high is None else estimator.clip_range_high
    with torch.no_grad():
        coefficient = ppo_clip_coefficient(
            batch.logprobs - batch.behaviour_logprobs,
            batch.advantages,
            clip_low=estimator.clip_range,
            clip_high=clip_high,
        )
        grad_values = (batch.values - batch.returns) * (estimator.value_loss_coef / count)
    return (coefficient * (-1.0 / count)).reshape(-1), grad_values.reshape(-1)


def backward(
    policy: MLPActorCritic, saved: SavedForward, loss: torch.Tensor, batch: ObjectiveBatch, estimator: EstimatorConfig
) -> None:
    """Write ∂loss/∂θ into every parameter's ``grad`` (overwritten, not accumulated); a network the loss does
    not read (the critic of a loss without value term) gets a zero gradient. ``loss`` is ``unified_objective``'s
    on ``batch``: its gradient at log π and V is ``objective_gradient``'s where that applies, else autograd's."""
    if objective_by_hand(estimator, batch):
        grad_logprobs, grad_values = objective_gradient(estimator, batch)
    else:
        grad_logprobs, grad_values = torch.autograd.grad(loss, [saved.logprobs, saved.values], allow_unused=True)
    with torch.no_grad():
        if grad_logprobs is None:
            _zero(policy.actor)
        else:  # ∂ log softmax(z)_a / ∂z = onehot(a) − softmax(z)
            grad_logits = (saved.probs * -grad_logprobs.unsqueeze(-1)).scatter_add_(
                -1, saved.actions, grad_logprobs.unsqueeze(-1)
            )
            _backward_network(policy.actor, saved.actor_inputs, grad_logits)
        if grad_values is None:
            _zero(policy.critic)
        else:
            _backward_network(policy.critic, saved.critic_inputs, grad_values.unsqueeze(-1))


def _zero(network: nn.Sequential) -> None:
    for parameter in network.parameters():
        if parameter.grad is not None:
            parameter.grad.zero_()
        else:
            parameter.grad = torch.zeros_like(parameter)


def _backward_network(network: nn.Sequential, inputs: list[torch.Tensor], delta: torch.Tensor) -> None:
    """Back-propagate ``delta`` (∂loss/∂output) through ``network``, whose linear layers read ``inputs``."""
    layers = [layer for layer in network if isinstance(layer, nn.Linear)]
    activations = [type(layer) for layer in network if not isinstance(layer, nn.Linear)]
    for position in range(len(layers) - 1, -1, -1):
        layer, layer_input = layers[position], inputs[position]
        torch.mm(delta.t(), layer_input, out=_grad(layer.weight))
        torch.sum(delta, 0, out=_grad(layer.bias))
        if position > 0:  # the input of this layer is the previous activation's output
            delta = torch.mm(delta, layer.weight) * _DERIVATIVE_FROM_OUTPUT[activations[position - 1]](layer_input)


def _grad(parameter: torch.Tensor) -> torch.Tensor:
    """The tensor a parameter's gradient is written into: its ``grad`` (a view of the learner's flat gradient)."""
    if parameter.grad is None:
        parameter.grad = torch.empty_like(parameter)
    return parameter.grad
