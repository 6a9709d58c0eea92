"""Reductions over the valid entries of a padded tensor.

Every function takes ``mask`` of the same shape as ``values`` (1 = valid, 0 = padding, bool or float).
``masked_sum`` and ``masked_mean`` also take None for a tensor without padding (a batch of environment steps):
a plain sum or mean then, without the mask's multiplications, which on a small batch cost more than the sum.
"""

from __future__ import annotations

import math

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor | None, dim: int | None = None) -> torch.Tensor:
    """Σ m·x over ``dim`` (all elements when ``dim`` is None); ``mask`` None: every entry valid."""
    if mask is None:
        return values.sum() if dim is None else values.sum(dim=dim)
    weighted = values * mask.to(values.dtype)
    return weighted.sum() if dim is None else weighted.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor | None, dim: int | None = None) -> torch.Tensor:
    """Σ m·x / max(Σ m, 1): the mean of the valid entries (0 when there are none); ``mask`` None: every entry
    valid, the plain mean."""
    if mask is None:
        return values.mean() if dim is None else values.mean(dim=dim)
    mask = mask.to(values.dtype)
    count = mask.sum() if dim is None else mask.sum(dim=dim)
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


def pack_masked(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move each row's valid entries to the front, keeping their order: (B, T) → (B, T') and its mask.

    Multi-turn episodes interleave the policy's tokens with inserted tool tokens; step-wise estimators
    (GAE, TD) must see the policy's tokens as consecutive steps, so they run on the packed tensor.
    ``unpack_masked`` puts results back in place.
    """
    valid = mask.bool()
    width = max(int(valid.sum(1).max()), 1) if valid.numel() else 1
    slots = valid.long().cumsum(1) - 1  # (B, T) packed position of each valid entry
    packed = values.new_zeros((values.shape[0], width))
    packed_mask = mask.new_zeros((values.shape[0], width))
    rows = torch.arange(values.shape[0], device=values.device)[:, None].expand_as(valid)
    packed[rows[valid], slots[valid]] = values[valid]
    packed_mask[rows[valid], slots[valid]] = 1
    return packed, packed_mask


def unpack_masked(packed: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_masked``: (B, T') → (B, T), 0 where ``mask`` is 0."""
    valid = mask.bool()
    slots = (valid.long().cumsum(1) - 1).clamp(min=0)
    return packed.gather(1, slots.clamp(max=packed.shape[1] - 1)) * valid.to(packed.dtype)


def top_fraction_mask(values: torch.Tensor, mask: torch.Tensor, fraction: float) -> torch.Tensor:
    """The ⌈fraction · N⌉ valid entries of largest ``values`` (at least one, N = valid entries) as a mask of
    ``mask``'s dtype; ``mask`` itself when ``fraction`` is 1. Used to keep the policy gradient on the highest-entropy
    tokens only (Wang et al. 2025, "Beyond the 80/20 Rule", arXiv:2506.01939: the top 20% "forking" tokens)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction ({fraction}) must lie in (0, 1]")
    if fraction == 1.0:
        return mask
    valid = mask.bool()
    count = int(valid.sum())
    keep = torch.zeros(values.numel(), dtype=mask.dtype, device=mask.device)
    if count:
        ranked = torch.where(valid, values.detach(), -torch.inf).flatten()
        keep[torch.topk(ranked, max(1, math.ceil(fraction * count))).indices] = 1
    return keep.view_as(mask)
