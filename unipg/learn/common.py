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
    if all(p.grad is None for p in parameters):
        return 0.0
    # an infinite limit scales every gradient by exactly 1: the norm is measured, nothing is clipped;
    # with sharded (FSDP2) gradients torch reduces the norm across ranks
    norm = torch.nn.utils.clip_grad_norm_(
        [p for p in parameters if p.grad is not None], math.inf if max_norm is None else max_norm
    )
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
