"""Reductions over the valid entries of a padded tensor.

Every function takes ``mask`` of the same shape as ``values`` (1 = valid, 0 = padding, bool or float).
"""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ m·x over ``dim`` (all elements when ``dim`` is None)."""
    weighted = values * mask.to(values.dtype)
    return weighted.sum() if dim is None else weighted.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ m·x / max(Σ m, 1): the mean of the valid entries (0 when there are none)."""
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1.0)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the valid entries; Bessel-corrected when ``unbiased`` and more than one entry."""
    mean = masked_mean(values, mask)
    count = mask.to(values.dtype).sum()
    sum_sq = masked_sum((values - mean) ** 2, mask)
    if unbiased and count > 1:
        return sum_sq / (count - 1)
    return sum_sq / count.clamp(min=1.0)


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """(x − mean) / std over the valid entries; padding stays 0.

    With ``shift_mean=False`` only the scale changes (x / std), which keeps the sign of every entry —
    the variant used when advantages must not be re-centred.
    """
    mean = masked_mean(values, mask)
    std = masked_var(values, mask).clamp(min=0.0).sqrt()
    centred = values - mean if shift_mean else values
    return centred / (std + eps) * mask.to(values.dtype)
