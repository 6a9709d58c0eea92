"""Trust Region Policy Optimization (Schulman et al. 2015, "Trust Region Policy Optimization").

TRPO solves, around the current parameters θ_old,

    max_θ  L(θ) = E_t[ π_θ(a_t|s_t) / π_old(a_t|s_t) · Â_t ]
    s.t.   KL̄(θ) = E_t[ KL(π_old(·|s_t) ‖ π_θ(·|s_t)) ] ≤ δ

by a quadratic model of the constraint: with g = ∇L and F the Fisher matrix (the Hessian of KL̄ at
θ_old), the step direction is s = F⁻¹g (conjugate gradient, paper appendix C), scaled to the edge of the
trust region, β = sqrt(2δ / sᵀFs) · s, and shrunk by a backtracking line search until the exact KL
constraint holds and L actually improves.

Everything here works on a list of parameter tensors and flat vectors, so it applies to any module.
The caller supplies two zero-argument closures evaluated at the current parameters:
    surrogate_fn() → scalar L(θ) to maximise (e.g. mean ρ · A)
    kl_fn()        → scalar mean KL(π_old ‖ π_θ), with π_old a DETACHED snapshot taken before the step
                     (comparing the policy with itself gives KL ≡ 0 and a zero Fisher matrix).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from unipg.registry import Registry

# TRPO is a step on the parameters, not a loss, so it is not in POLICY_LOSSES; this registry declares what
# ``estimator.policy_loss: trpo`` reads (setting name → keyword of ``trpo_step``).
TRUST_REGION_STEPS = Registry("trust-region step")


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors into one flat vector (P,)."""
    return torch.cat([tensor.reshape(-1) for tensor in tensors])


def flat_grad(
    output: torch.Tensor,
    params: Sequence[torch.Tensor],
    *,
    create_graph: bool = False,
    retain_graph: bool | None = None,
) -> torch.Tensor:
    """∇_θ output as a flat vector (P,); parameters the output does not depend on get zeros."""
    grads = torch.autograd.grad(
        output, list(params), create_graph=create_graph, retain_graph=retain_graph, allow_unused=True
    )
    return flatten([torch.zeros_like(p) if grad is None else grad for p, grad in zip(params, grads)])


def assign_flat(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy a flat vector (P,) into ``params`` in place (no autograd history)."""
    total = sum(p.numel() for p in params)
    if flat.numel() != total:
        raise ValueError(f"flat vector has {flat.numel()} entries but the parameters have {total}")
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def conjugate_gradient(
    matvec: Callable[[torch.Tensor], torch.Tensor],
    b: torch.Tensor,
    *,
    iterations: int = 10,
    residual_tol: float = 1e-10,
) -> torch.Tensor:
    """Solve A x = b for symmetric positive-definite A, given only v ↦ A v (Hestenes & Stiefel 1952).

    Starting from x = 0, r = p = b:  α = rᵀr / pᵀAp;  x += α p;  r −= α A p;  p = r + (r'ᵀr' / rᵀr) p.
    Stops after ``iterations`` products or once the squared residual rᵀr < ``residual_tol``; exact after
    dim(b) iterations in exact arithmetic.
    """
    x = torch.zeros_like(b)
    residual = b.clone()
    direction = b.clone()
    residual_sq = residual.dot(residual)
    for _ in range(iterations):
        if residual_sq < residual_tol:
            break
        a_direction = matvec(direction)
        curvature = direction.dot(a_direction)
        if curvature <= 0:  # A is not positive definite along p; x so far is the best we have
            break
        step = residual_sq / curvature
        x = x + step * direction
        residual = residual - step * a_direction
        new_residual_sq = residual.dot(residual)
        direction = residual + (new_residual_sq / residual_sq) * direction
        residual_sq = new_residual_sq
    return x


def fisher_vector_product(
    kl_fn: Callable[[], torch.Tensor],
    params: Sequence[torch.Tensor],
    vector: torch.Tensor,
    *,
    damping: float = 0.1,
) -> torch.Tensor:
    """(F + damping · I) v, with F = ∇²_θ KL̄(π_old ‖ π_θ) at θ = θ_old (the Fisher information matrix).

    Double back-propagation (Pearlmutter 1994): g = ∇KL̄ with its graph kept, then F v = ∇(gᵀv).
    The damping keeps the conjugate-gradient system well conditioned where F is (near) singular.
    """
    kl = kl_fn()
    kl_grad = flat_grad(kl, params, create_graph=True)  # (P,)
    grad_dot_vector = (kl_grad * vector.detach()).sum()
    if grad_dot_vector.requires_grad:
        hessian_vector = flat_grad(grad_dot_vector, params)  # (P,)
    else:  # KL does not depend on θ at second order (e.g. constant): F = 0
        hessian_vector = torch.zeros_like(vector)
    return hessian_vector + damping * vector


@dataclass
class TRPOStepResult:
    """What one TRPO update did; every field is a plain number for logging."""

    accepted: bool  # a line-search candidate satisfied the constraint; False → θ restored to θ_old
    step_fraction: float  # α^k of the accepted candidate (0 when none was accepted)
    kl: float  # KL(π_old ‖ π_new) of the accepted candidate, or of the last candidate tried when rejected
    surrogate_improvement: float  # L(θ_new) − L(θ_old) of that candidate
    expected_improvement: float  # gᵀ(α^k β), the first-order prediction of that improvement
    line_search_steps: int  # candidates evaluated
    step_norm: float  # ‖θ_new − θ_old‖ of the accepted step (0 when rejected)


@TRUST_REGION_STEPS.register(
    "trpo",
    inputs=("params", "surrogate_fn", "kl_fn"),
    options={
        "max_kl": "max_kl",
        "cg_damping": "damping",
        "cg_iterations": "cg_iterations",
        "backtrack_coef": "backtrack_coef",
        "line_search_steps": "max_backtracks",
    },
)
def trpo_step(
    params: Sequence[torch.Tensor],
    surrogate_fn: Callable[[], torch.Tensor],
    kl_fn: Callable[[], torch.Tensor],
    *,
    max_kl: float = 0.01,
    damping: float = 0.1,
    cg_iterations: int = 10,
    backtrack_coef: float = 0.5,
    max_backtracks: int = 10,
    accept_ratio: float = 0.1,
) -> TRPOStepResult:
    """One TRPO update of ``params`` in place (Schulman et al. 2015, §6 and appendix C).

    g = ∇L(θ_old);  s = CG(F + damping·I, g);  β = sqrt(2δ / sᵀFs) · s;
    try θ_old + α^k β for k = 0 … max_backtracks−1 and accept the first with KL̄ ≤ δ, L improvement > 0
    and improvement / (gᵀ α^k β) ≥ accept_ratio. If none qualifies, θ_old is restored exactly.
    """
    _check_trpo_hyperparameters(max_kl, damping, cg_iterations, backtrack_coef, max_backtracks)
    old_params = flatten([p.detach() for p in params]).clone()  # (P,)
    surrogate_old = surrogate_fn()
    gradient = flat_grad(surrogate_old, params)  # (P,)
    surrogate_old = float(surrogate_old.detach())
    rejected = TRPOStepResult(False, 0.0, 0.0, 0.0, 0.0, 0, 0.0)
    if not torch.isfinite(gradient).all() or not gradient.abs().sum() > 0:
        return rejected  # nothing to climb (or a broken gradient): leave θ alone

    def fisher(vector: torch.Tensor) -> torch.Tensor:
        return fisher_vector_product(kl_fn, params, vector, damping=damping)

    direction = conjugate_gradient(fisher, gradient, iterations=cg_iterations)  # (P,) ≈ F⁻¹g
    curvature = float(direction.dot(fisher(direction)))  # sᵀFs
    if not math.isfinite(curvature) or curvature <= 0:
        return rejected
    full_step = math.sqrt(2.0 * max_kl / curvature) * direction  # (P,) β, on the trust-region boundary
    full_expected = float(gradient.dot(full_step))

    result = rejected
    for k in range(max_backtracks):
        fraction = backtrack_coef**k
        assign_flat(params, old_params + fraction * full_step)
        with torch.no_grad():
            kl = float(kl_fn())
            improvement = float(surrogate_fn()) - surrogate_old
        expected = full_expected * fraction
        result = TRPOStepResult(False, 0.0, kl, improvement, expected, k + 1, 0.0)
        ratio_ok = expected <= 0 or improvement / expected >= accept_ratio
        if math.isfinite(kl) and kl <= max_kl and improvement > 0 and ratio_ok:
            step_norm = float((fraction * full_step).norm())
            return TRPOStepResult(True, fraction, kl, improvement, expected, k + 1, step_norm)
    assign_flat(params, old_params)
    return result


def _check_trpo_hyperparameters(
    max_kl: float, damping: float, cg_iterations: int, backtrack_coef: float, max_backtracks: int
) -> None:
    if max_kl <= 0:
        raise ValueError(f"max_kl δ ({max_kl}) must be > 0; the paper uses 0.01")
    if damping < 0:
        raise ValueError(f"damping ({damping}) must be ≥ 0; 0.1 is typical")
    if cg_iterations < 1:
        raise ValueError(f"cg_iterations ({cg_iterations}) must be ≥ 1; 10 is typical")
    if not 0 < backtrack_coef < 1:
        raise ValueError(f"backtrack_coef ({backtrack_coef}) must be in (0, 1); 0.5 halves the step each try")
    if max_backtracks < 1:
        raise ValueError(f"max_backtracks ({max_backtracks}) must be ≥ 1")
