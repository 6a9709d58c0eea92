import copy

import gymnasium as gym
import torch

from unipg.config import load_config
from unipg.learn.flat_adam import FlatAdam
from unipg.learn.gym import GradientLearner
from unipg.learn.state import optimizer_tensors
from unipg.policy.mlp import MLPActorCritic


def _policy(seed: int = 0) -> MLPActorCritic:
    torch.manual_seed(seed)
    return MLPActorCritic(gym.spaces.Box(-1, 1, (4,)), gym.spaces.Discrete(2), hidden_sizes=[16, 16])


def _loss(policy: MLPActorCritic, observations: torch.Tensor) -> torch.Tensor:
    logits = torch.log_softmax(policy.distribution(observations).logits, -1)
    return logits[:, 0].mean() + policy.value(observations).square().mean()


def _per_parameter_adam(policy: MLPActorCritic, actor_lr: float, critic_lr: float) -> torch.optim.Adam:
    """The optimizer as learners built it before flat parameters: one Adam state per parameter tensor."""
    groups = [
        {"params": policy.actor_parameters(), "lr": actor_lr, "base_lr": actor_lr},
        {"params": policy.critic_parameters(), "lr": critic_lr, "base_lr": critic_lr},
    ]
    return torch.optim.Adam(groups, eps=1e-5, fused=True)


def _reference_step(policy: MLPActorCritic, optimizer: torch.optim.Adam, observations: torch.Tensor, max_norm: float):
    optimizer.zero_grad(set_to_none=True)
    _loss(policy, observations).backward()
    norm = torch.nn.utils.clip_grad_norm_(list(policy.parameters()), max_norm)
    optimizer.step()
    return norm


def test_flat_adam_takes_the_steps_of_adam_over_separate_parameters():
    reference, flat = _policy(), _policy()
    optimizer = _per_parameter_adam(reference, 1e-2, 3e-2)
    adam = FlatAdam([(flat.actor_parameters(), 1e-2), (flat.critic_parameters(), 3e-2)], eps=1e-5)
    for step in range(6):
        observations = torch.randn(32, 4)
        if step == 3:  # a learning-rate schedule writes the groups' lr between steps
            for group in (*optimizer.param_groups, *adam.optimizer.param_groups):
                group["lr"] *= 0.5
        expected_norm = _reference_step(reference, optimizer, observations, max_norm=0.05)
        adam.zero_grad()
        _loss(flat, observations).backward()
        norm = adam.clip_grad_norm(0.05)
        adam.step()
        torch.testing.assert_close(norm, expected_norm)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(flat.state_dict()[name], value, rtol=1e-5, atol=1e-6)


def test_parameters_become_views_of_the_flat_tensors_with_their_values_kept():
    policy = _policy()
    before = copy.deepcopy(policy.state_dict())
    adam = FlatAdam([(policy.actor_parameters(), 1e-3), (policy.critic_parameters(), 1e-3)], eps=1e-5)
    assert all(torch.equal(policy.state_dict()[name], value) for name, value in before.items())
    adam.flats[1].data.add_(1.0)  # an update of the flat tensor is an update of the critic's parameters
    assert all(torch.equal(p, before_p + 1.0) for p, before_p in zip(policy.critic_parameters(), _critic(before)))
    adam.zero_grad()
    _loss(policy, torch.randn(8, 4)).backward()
    assert all(p.grad.data_ptr() in range(g.data_ptr(), g.data_ptr() + g.numel() * 4) for p, g in _pairs(adam, policy))


def _critic(state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [value for name, value in state.items() if name.startswith("critic.")]


def _pairs(adam: FlatAdam, policy: MLPActorCritic):
    yield from ((p, adam.grads[0]) for p in policy.actor_parameters())
    yield from ((p, adam.grads[1]) for p in policy.critic_parameters())


def test_a_learner_continues_a_checkpoint_written_with_one_adam_state_per_parameter():
    config = load_config(None, ["seed=0"])
    reference, resumed = _policy(), _policy()
    optimizer = _per_parameter_adam(reference, config.train.learning_rate, config.train.learning_rate)
    for _ in range(3):
        _reference_step(reference, optimizer, torch.randn(32, 4), max_norm=0.5)
    resumed.load_state_dict(reference.state_dict())
    learner = GradientLearner(resumed, config)
    tensors, meta = optimizer_tensors(optimizer)
    learner.restore(tensors, {"optimizer": meta, "generator": learner.checkpoint()[1]["generator"]})
    observations = torch.randn(32, 4)
    _reference_step(reference, optimizer, observations, max_norm=0.5)
    learner.adam.zero_grad()
    _loss(resumed, observations).backward()
    learner.adam.clip_grad_norm(0.5)
    learner.adam.step()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value, rtol=1e-5, atol=1e-6)


def test_a_step_moves_the_parameters_version_counters():
    """The parameters are views of the flat tensors through ``.data``, with counters of their own: a step must
    move them, or a cache of the weights (acting) would not see the update."""
    policy = _policy()
    adam = FlatAdam([(policy.actor_parameters(), 1e-2), (policy.critic_parameters(), 1e-2)], eps=1e-5)
    observations = torch.randn(8, 4)
    before = policy.act(observations).values
    for _ in range(2):  # the first step creates Adam's state, the second takes the fused path
        versions = [p._version for p in policy.parameters()]
        adam.zero_grad()
        _loss(policy, observations).backward()
        adam.step()
        assert all(p._version > version for p, version in zip(policy.parameters(), versions))
    after = policy.act(observations).values
    assert not torch.equal(after, before)
    torch.testing.assert_close(after, policy.value(observations))
