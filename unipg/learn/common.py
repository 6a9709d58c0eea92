"""Optimisation helpers shared by the gymnasium and the language-model learners."""

from __future__ import annotations

import math

import torch


def shuffled_minibatches(valid: torch.Tensor, size: int, *, epochs: int, generator: torch.Generator):
    """Index tensors of mini-batches over the ``valid`` sample indices, reshuffled every epoch.

    Masked (Monte-Carlo) batches need not divide evenly: the last mini-batch of an epoch may be smaller.
    """
    for _ in range(epochs):
        yield from torch.split(valid[torch.randperm(len(valid), generator=generator)], size)


def clip_grad_norm(parameters: list[torch.Tensor], max_norm: float | None) -> float:
    """Clip the global gradient norm to ``max_norm`` (None: only measure it); returns the pre-clip norm."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    # an infinite limit scales every gradient by exactly 1: the norm is measured, nothing is clipped
    limit = math.inf if max_norm is None else max_norm
    if all(type(grad) is torch.Tensor for grad in grads) and len({(g.device, g.dtype) for g in grads}) == 1:
        return float(clip_plain_grads(grads, limit))
    # with sharded (FSDP2) gradients torch reduces the norm across ranks
    norm = torch.nn.utils.clip_grad_norm_([p for p in parameters if p.grad is not None], limit)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


@torch.no_grad()
def clip_plain_grads(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``'s arithmetic, step for step, for plain gradients on one device and of one
    dtype: the same result without its per-call grouping by device and dtype, which costs more than the arithmetic
    on a small network (each PPO mini-batch step of a classic-control MLP). Returns the pre-clip norm as a 0-d
    tensor, for callers that read it later (``math.inf``: only measure it)."""
    if len(grads) == 1:  # the norm of the one norm is that norm, exactly (√(x²) = |x| in IEEE arithmetic)
        norm = torch.linalg.vector_norm(grads[0], 2.0)
    else:
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm
