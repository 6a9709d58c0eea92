"""A reference policy that follows the policy: TR-DPO's soft update of π_ref.

The KL penalty β·KL(π_θ‖π_ref) pulls the policy back towards a frozen reference. Gorbatovski et al. 2024 (TR-DPO,
arXiv:2404.09656) let the reference move instead: every τ updates its weights become

    θ_ref ← α · θ + (1 − α) · θ_ref,

so the penalty keeps the policy near where it recently was rather than where it started (α = 1: the reference is
reset to the policy, TR-DPO's hard update; α → 0: it stays frozen). TRL calls the settings ``ref_model_mixup_alpha``
(α, 0.6 by default) and ``ref_model_sync_steps`` (τ).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


@torch.no_grad()
def soft_update_reference(reference: Iterable[torch.Tensor], policy: Iterable[torch.Tensor], *, alpha: float) -> None:
    """θ_ref ← α · θ + (1 − α) · θ_ref, in place, for each pair of matching tensors of ``reference`` and ``policy``
    (the parameters of two copies of one architecture, in the same order); ``alpha`` α in (0, 1].

    A policy tensor in another dtype (float32 masters of bfloat16 weights) is cast to the reference's first.
    """
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"the reference mixing weight α ({alpha}) must lie in (0, 1]; 1 copies the policy")
    reference, policy = list(reference), list(policy)
    if len(reference) != len(policy):
        raise ValueError(f"the reference has {len(reference)} tensors, the policy {len(policy)}: not one architecture")
    for ref, current in zip(reference, policy):
        if ref.shape != current.shape:
            raise ValueError(f"a reference tensor of shape {tuple(ref.shape)} meets one of {tuple(current.shape)}")
        ref.copy_(alpha * current.to(ref.dtype) + (1.0 - alpha) * ref)
