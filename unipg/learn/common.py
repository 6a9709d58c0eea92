"""Optimisation helpers shared by the gymnasium and the language-model learners."""

from __future__ import annotations

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
    if any(hasattr(grad, "full_tensor") for grad in grads):  # sharded (FSDP2): torch reduces across ranks
        norm = torch.nn.utils.clip_grad_norm_([p for p in parameters if p.grad is not None],
                                              float("inf") if max_norm is None else max_norm, foreach=True)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    if max_norm is not None:
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return float(norm)
