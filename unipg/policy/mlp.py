"""MLP actor-critic for gymnasium environments: a categorical or diagonal-Gaussian policy and a critic.

Actor and critic are separate networks (no shared trunk), the usual choice for classic control because the
two losses then cannot fight over shared features. Initialisation follows the PPO implementation details
(Huang et al. 2022): orthogonal weights with gain √2, 0.01 on the policy head, 1 on the value head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import gymnasium as gym
import torch
from torch import nn
from torch.distributions import Categorical, Distribution, Independent, Normal

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU}
# each activation module's arithmetic as a function, for ``run_mlp``
_ACTIVATION_FUNCTIONS = {nn.Tanh: torch.tanh, nn.ReLU: torch.relu}


def mlp(sizes: list[int], activation: str, output_gain: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for index, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        linear = nn.Linear(fan_in, fan_out)
        last = index == len(sizes) - 2
        nn.init.orthogonal_(linear.weight, gain=output_gain if last else math.sqrt(2))
        nn.init.zeros_(linear.bias)
        layers.append(linear)
        if not last:
            layers.append(ACTIVATIONS[activation]())
    return nn.Sequential(*layers)


def run_mlp(network: nn.Sequential, inputs: torch.Tensor) -> torch.Tensor:
    """``network(inputs)`` for a network built by ``mlp``, layer by layer as functions: the same arithmetic without
    ``nn.Module.__call__``'s hook handling, which on a 64-64 MLP costs as much as the layers' arithmetic (this runs
    once per environment step and twice per PPO mini-batch step)."""
    for layer in network:
        if isinstance(layer, nn.Linear):
            inputs = torch.nn.functional.linear(inputs, layer.weight, layer.bias)
        else:
            inputs = _ACTIVATION_FUNCTIONS[type(layer)](inputs)
    return inputs


def joint_layers(actor: nn.Sequential, critic: nn.Sequential) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two networks built by ``mlp`` with the same hidden sizes as one network of twice the width, whose output is
    the actor's output followed by the critic's: [(weightᵀ, bias)] per layer, detached copies. The first layer
    stacks both input weights, the others are block-diagonal, so each unit only reads its own network's units.
    Acting then takes one matrix product per layer instead of two (``MLPActorCritic.act``)."""
    layers = []
    for index, (actor_layer, critic_layer) in enumerate(
        (a, c) for a, c in zip(actor, critic, strict=True) if isinstance(a, nn.Linear)
    ):
        stack = torch.cat if index == 0 else lambda weights: torch.block_diag(*weights)
        weight = stack([actor_layer.weight.detach(), critic_layer.weight.detach()])
        layers.append((weight.t().contiguous(), torch.cat([actor_layer.bias.detach(), critic_layer.bias.detach()])))
    return layers


@dataclass
class ActionSample:
    actions: torch.Tensor  # (N,) int64 for discrete, (N, A) float for continuous
    logprobs: torch.Tensor  # (N,) log π(a|s) of the sampled actions
    values: torch.Tensor  # (N,) V(s)


class MLPActorCritic(nn.Module):
    """π_θ(a|s) and V_φ(s) for a Box observation space and a Discrete or Box action space."""

    def __init__(
        self,
        observation_space: gym.Space,
        action_space: gym.Space,
        *,
        hidden_sizes: list[int],
        activation: str = "tanh",
        log_std_init: float = 0.0,
    ):
        super().__init__()
        if not isinstance(observation_space, gym.spaces.Box) or len(observation_space.shape) != 1:
            raise ValueError(
                f"MLP policies need a flat Box observation space, got {observation_space}; "
                "wrap the environment with gymnasium.wrappers.FlattenObservation"
            )
        obs_dim = observation_space.shape[0]
        self.discrete = isinstance(action_space, gym.spaces.Discrete)
        if self.discrete:
            out_dim = int(action_space.n)
        elif isinstance(action_space, gym.spaces.Box) and len(action_space.shape) == 1:
            out_dim = action_space.shape[0]
            self.log_std = nn.Parameter(torch.full((out_dim,), float(log_std_init)))
        else:
            raise ValueError(f"MLP policies support Discrete or flat Box action spaces, got {action_space}")
        self.actor = mlp([obs_dim, *hidden_sizes, out_dim], activation, output_gain=0.01)
        self.critic = mlp([obs_dim, *hidden_sizes, 1], activation, output_gain=1.0)
        self._activation = _ACTIVATION_FUNCTIONS[ACTIVATIONS[activation]]
        # (the parameters' versions and addresses, ``joint_layers``) as of the last ``act``
        self._joint: tuple[tuple, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        self._parameters_in_order = tuple(self.actor.parameters()) + tuple(self.critic.parameters())

    def actor_parameters(self) -> list[nn.Parameter]:
        params = list(self.actor.parameters())
        return params + [self.log_std] if not self.discrete else params

    def critic_parameters(self) -> list[nn.Parameter]:
        return list(self.critic.parameters())

    def distribution(self, observations: torch.Tensor) -> Distribution:
        """π_θ(·|s) for a batch of observations (N, obs_dim)."""
        out = run_mlp(self.actor, observations)
        if self.discrete:
            return Categorical(logits=out, validate_args=False)
        return Independent(Normal(out, self.log_std.exp().expand_as(out), validate_args=False), 1, validate_args=False)

    def value(self, observations: torch.Tensor) -> torch.Tensor:
        """V_φ(s), shape (N,)."""
        return run_mlp(self.critic, observations).squeeze(-1)

    def act(self, observations: torch.Tensor, *, deterministic: bool = False) -> ActionSample:
        """An action for each observation, with its log-probability and V(s); no gradient."""
        if not self.discrete:
            return self._act_continuous(observations, deterministic=deterministic)
        # once per environment step: actor and critic as one network of detached weights (no graph is recorded,
        # without a no_grad context), and Categorical's arithmetic without building the object
        out = observations
        layers = self._joint_layers()
        for index, (weight_t, bias) in enumerate(layers):
            out = torch.addmm(bias, out, weight_t)
            if index < len(layers) - 1:
                out = self._activation(out)
        logits, values = torch.log_softmax(out[:, :-1], dim=-1), out[:, -1]  # log π(·|s), V(s)
        probs = logits.exp()
        actions = probs.argmax(-1) if deterministic else torch.multinomial(probs, 1, True).squeeze(-1)
        logprobs = logits.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        return ActionSample(actions, logprobs, values)

    def _joint_layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``joint_layers`` of the current parameters, rebuilt when one has changed since the last call: an
        optimizer step or a weight load writes them in place, which moves their version counter; a
        re-assigned ``.data`` moves their address."""
        key = tuple((p._version, p.data_ptr()) for p in self._parameters_in_order)
        if self._joint is None or self._joint[0] != key:
            with torch.no_grad():
                self._joint = key, joint_layers(self.actor, self.critic)
        return self._joint[1]

    @torch.no_grad()
    def _act_continuous(self, observations: torch.Tensor, *, deterministic: bool) -> ActionSample:
        dist = self.distribution(observations)
        actions = dist.mean if deterministic else dist.sample()
        return ActionSample(actions, dist.log_prob(actions), self.value(observations))

    def evaluate(self, observations: torch.Tensor, actions: torch.Tensor, *, entropy_grad: bool = True):
        """(log π_θ(a|s), entropy of π_θ(·|s), V_φ(s)), each (N,), differentiable; the entropy only with
        ``entropy_grad`` (else detached: a learner without entropy bonus only reports it, and the graph is smaller)."""
        if self.discrete:  # the learner's hot path: log-softmax once, without a Distribution object
            logprobs_all = torch.log_softmax(run_mlp(self.actor, observations), dim=-1)  # (N, n_actions)
            logprobs = logprobs_all.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropy = -(logprobs_all.exp() * logprobs_all).sum(-1)
            return logprobs, entropy, self.value(observations)
        dist = self.distribution(observations)
        entropy = dist.entropy() if entropy_grad else dist.entropy().detach()
        return dist.log_prob(actions), entropy, self.value(observations)
