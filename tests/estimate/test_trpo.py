"""TRPO pieces: conjugate gradient, Fisher-vector product, and the constrained step on a softmax policy."""

import pytest
import torch

from unipg.estimate.trpo import (
    TRPOStepResult,
    assign_flat,
    conjugate_gradient,
    fisher_vector_product,
    flat_grad,
    flatten,
    trpo_step,
)

N_STATES, STATE_DIM, N_ACTIONS = 16, 4, 3


def test_conjugate_gradient_solves_known_3x3_system():
    matrix = torch.tensor([[4.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 2.0]], dtype=torch.float64)
    b = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    x = conjugate_gradient(lambda v: matrix @ v, b, iterations=3, residual_tol=1e-30)
    torch.testing.assert_close(x, torch.linalg.solve(matrix, b), atol=1e-6, rtol=0)
    torch.testing.assert_close(matrix @ x, b, atol=1e-6, rtol=0)


def test_conjugate_gradient_solves_random_20x20_spd_system():
    generator = torch.Generator().manual_seed(0)
    factor = torch.randn(20, 20, generator=generator, dtype=torch.float64)
    matrix = factor @ factor.T + 1.0 * torch.eye(20, dtype=torch.float64)
    b = torch.randn(20, generator=generator, dtype=torch.float64)
    x = conjugate_gradient(lambda v: matrix @ v, b, iterations=100, residual_tol=1e-24)
    torch.testing.assert_close(x, torch.linalg.solve(matrix, b), atol=1e-6, rtol=0)


def test_conjugate_gradient_of_zero_is_zero():
    x = conjugate_gradient(lambda v: 2 * v, torch.zeros(5))
    assert torch.equal(x, torch.zeros(5))


def test_flatten_and_assign_flat_round_trip():
    params = [torch.zeros(2, 3, requires_grad=True), torch.zeros(4, requires_grad=True)]
    flat = torch.arange(10.0)
    assign_flat(params, flat)
    assert torch.equal(flatten(params), flat)
    assert torch.equal(params[0], torch.arange(6.0).view(2, 3))
    with pytest.raises(ValueError, match="10"):
        assign_flat(params, torch.zeros(9))


def test_flat_grad_gives_zeros_for_unused_parameters():
    used, unused = torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)
    grad = flat_grad((3 * used).sum(), [used, unused])
    torch.testing.assert_close(grad, torch.tensor([3.0, 3.0, 0.0, 0.0, 0.0]))


def make_policy(seed: int = 0, dtype=torch.float32):
    """A linear-softmax policy π(a|s) = softmax(W s + b) over a fixed batch of states."""
    generator = torch.Generator().manual_seed(seed)
    states = torch.randn(N_STATES, STATE_DIM, generator=generator, dtype=dtype)
    weight = (0.5 * torch.randn(N_ACTIONS, STATE_DIM, generator=generator, dtype=dtype)).requires_grad_()
    bias = (0.1 * torch.randn(N_ACTIONS, generator=generator, dtype=dtype)).requires_grad_()
    return states, [weight, bias]


def log_policy(states, weight, bias):
    return torch.log_softmax(states @ weight.T + bias, dim=-1)  # (N, A)


def mean_kl(old_log_probs, new_log_probs):
    """Mean over states of KL(π_old ‖ π_new) = Σ_a π_old (log π_old − log π_new)."""
    return (old_log_probs.exp() * (old_log_probs - new_log_probs)).sum(-1).mean()


def make_kl_fn(states, params):
    old_log_probs = log_policy(states, *params).detach()  # the snapshot the trust region is centred on
    return lambda: mean_kl(old_log_probs, log_policy(states, *params))


def test_fisher_vector_product_matches_explicit_hessian_of_mean_kl():
    states, params = make_policy(dtype=torch.float64)
    old_log_probs = log_policy(states, *params).detach()
    weight_numel = params[0].numel()

    def kl_of_flat(theta):
        weight = theta[:weight_numel].view(N_ACTIONS, STATE_DIM)
        return mean_kl(old_log_probs, log_policy(states, weight, theta[weight_numel:]))

    theta = flatten([p.detach() for p in params])
    hessian = torch.autograd.functional.hessian(kl_of_flat, theta)  # (P, P) Fisher at θ_old
    assert hessian.abs().max() > 1e-3  # a KL that compares the policy with itself would give F = 0
    vector = torch.randn(theta.numel(), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    damping = 0.1
    product = fisher_vector_product(make_kl_fn(states, params), params, vector, damping=damping)
    torch.testing.assert_close(product, hessian @ vector + damping * vector, atol=1e-10, rtol=1e-8)


def make_trpo_problem(seed: int = 0, advantage_scale: float = 1.0):
    """Surrogate L(θ) = mean ρ·A on sampled actions, with positive advantage for action 0 only."""
    states, params = make_policy(seed)
    old_log_probs = log_policy(states, *params).detach()
    actions = torch.multinomial(old_log_probs.exp(), 1, generator=torch.Generator().manual_seed(seed)).squeeze(-1)
    advantages = advantage_scale * (actions == 0).float()  # (N,)
    old_action_log_probs = old_log_probs.gather(-1, actions[:, None]).squeeze(-1)

    def surrogate_fn():
        new_action_log_probs = log_policy(states, *params).gather(-1, actions[:, None]).squeeze(-1)
        return (torch.exp(new_action_log_probs - old_action_log_probs) * advantages).mean()

    return params, surrogate_fn, make_kl_fn(states, params)


def test_trpo_step_improves_surrogate_within_trust_region():
    params, surrogate_fn, kl_fn = make_trpo_problem()
    before = [p.detach().clone() for p in params]
    surrogate_before = surrogate_fn().item()
    max_kl = 0.01
    result = trpo_step(params, surrogate_fn, kl_fn, max_kl=max_kl)
    assert isinstance(result, TRPOStepResult) and result.accepted
    kl_after = kl_fn().item()
    assert kl_after <= max_kl + 1e-6
    assert kl_after == pytest.approx(result.kl, rel=1e-5)
    assert surrogate_fn().item() - surrogate_before == pytest.approx(result.surrogate_improvement, rel=1e-4)
    assert result.surrogate_improvement > 0 and result.expected_improvement > 0
    assert any(not torch.equal(p, b) for p, b in zip(params, before))
    step = flatten([p.detach() for p in params]) - flatten(before)
    assert step.norm().item() == pytest.approx(result.step_norm, rel=1e-5)
    assert 0 < result.step_fraction <= 1 and result.line_search_steps >= 1
    # the step goes to the edge of the trust region: KL is of the order of δ, not negligible
    assert kl_after > 0.1 * max_kl


def test_trpo_step_restores_params_when_no_candidate_is_accepted():
    params, surrogate_fn, kl_fn = make_trpo_problem()
    before = [p.detach().clone() for p in params]
    # no candidate can beat a thousandfold the first-order prediction, so every one is rejected
    result = trpo_step(params, surrogate_fn, kl_fn, accept_ratio=1e3, max_backtracks=4)
    assert not result.accepted and result.line_search_steps == 4 and result.step_fraction == 0.0
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_trpo_step_with_zero_gradient_does_nothing():
    params, surrogate_fn, kl_fn = make_trpo_problem(advantage_scale=0.0)
    before = [p.detach().clone() for p in params]
    result = trpo_step(params, surrogate_fn, kl_fn)
    assert not result.accepted and result.line_search_steps == 0
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    numbers = [result.kl, result.surrogate_improvement, result.expected_improvement, result.step_norm]
    assert all(number == number for number in numbers)  # no NaN


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_kl": 0.0}, "max_kl"),
        ({"damping": -1.0}, "damping"),
        ({"backtrack_coef": 1.0}, "backtrack_coef"),
        ({"max_backtracks": 0}, "max_backtracks"),
        ({"cg_iterations": 0}, "cg_iterations"),
    ],
)
def test_trpo_step_rejects_invalid_hyperparameters(kwargs, message):
    params, surrogate_fn, kl_fn = make_trpo_problem()
    with pytest.raises(ValueError, match=message):
        trpo_step(params, surrogate_fn, kl_fn, **kwargs)
