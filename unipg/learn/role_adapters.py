"""The learner's side of ``agent.role_policy: adapters``: one LoRA adapter per role, each trained on its role's rows.

The policy holds one adapter per role of a multi-role task (``unipg.policy.adapters``). Each row of a batch is one
role's side of an episode (``Trajectory.role``), so the learner

- plans the micro-batches of each role's rows apart, and runs each with its role's adapter active: a role's
  tokens reach its own adapter's parameters only, the others get no gradient from them;
- gives each role's adapter a parameter group of its own in the optimizer; AdamW keeps its moments per
  parameter, so each role has its own optimizer state, and an optimizer step leaves a role's adapter and its
  state untouched when the role had no loss token in the mini-batch (its gradients are dropped, not zeroed);
- clips each role's gradient norm on its own (``train.max_grad_norm``), so one role's large gradient does not
  shrink another's step, and reports it as ``role/<role>/grad_norm``.

Without role adapters (``names`` empty) every method leaves the learner as it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext

import torch

from unipg.learn.common import clip_grad_norm
from unipg.learn.micro_batches import MicroBatches
from unipg.policy.adapters import role_adapter, role_adapter_names, role_adapter_parameters


class RoleAdapters:
    """The roles of a policy's adapters and the role of each row of the batch being learned from."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.names = role_adapter_names(model)  # empty: one adapter (or none) for every row
        self.rows: list[str] | None = None  # the role of each row of the current batch (``assign``)

    def __bool__(self) -> bool:
        return bool(self.names)

    def parameter_groups(self, optimized: Callable[[list], list], lr: float) -> list[dict]:
        """One optimizer parameter group per role (``optimized``: the parameters the optimizer steps for the
        model's, ``Float32Masters.optimized``); the group names its ``role``."""
        return [
            {"params": optimized(role_adapter_parameters(self.model, role)), "lr": lr, "base_lr": lr, "role": role}
            for role in self.names
        ]

    def assign(self, roles: list[str] | None) -> None:
        """The roles of the next batch's rows (required with role adapters; a role without an adapter is an error)."""
        if not self.names:
            return
        if roles is None:
            raise ValueError("a policy with an adapter per role learns from batches whose rows name their role")
        unknown = sorted(set(roles) - set(self.names))
        if unknown:
            raise ValueError(f"rows of role(s) {', '.join(unknown)}, which have no adapter (roles: {self.names})")
        self.rows = list(roles)

    def role_of(self, rows: torch.Tensor) -> str | None:
        """The role of a micro-batch's rows (all of one role; None without role adapters)."""
        return self.rows[int(rows[0])] if self.names else None

    def active(self, rows: torch.Tensor):
        """A context in which the adapter of ``rows``' role is the active one."""
        return role_adapter(self.model, self.role_of(rows)) if self.names else nullcontext()

    def run(self, rows: torch.Tensor, pass_of: Callable, chunk):
        """``pass_of(chunk)`` with the adapter of ``rows``' role (the chunk's rows) active."""
        with self.active(rows):
            return pass_of(chunk)

    def plan(self, rows: torch.Tensor, plan: Callable[..., MicroBatches]) -> MicroBatches:
        """``plan(rows)``, or with role adapters the micro-batches of each role's rows planned apart (none mixes
        roles), in role order; all padded (``plan(rows, padded=True)``) when some roles' plans pack and others' do
        not, since a policy's passes either all pack or none does."""
        if not self.names:
            return plan(rows)
        per_role = [
            rows[torch.tensor([self.rows[int(row)] == role for row in rows], dtype=torch.bool)] for role in self.names
        ]
        per_role = [mine for mine in per_role if len(mine)]
        plans = [plan(mine) for mine in per_role]
        if len({p.packed for p in plans}) > 1:
            plans = [plan(mine, padded=True) for mine in per_role]
        return MicroBatches([group for p in plans for group in p.groups], packed=plans[0].packed)

    def clip(self, groups: list[dict], mini_rows: torch.Tensor, loss_mask: torch.Tensor, max_norm: float | None):
        """Before an optimizer step over ``groups`` (its parameter groups): drop the gradients of the roles without a
        loss token among ``mini_rows`` (``loss_mask``: the batch's, (B, C)), so that the step leaves their adapters
        and optimizer state as they are; clip each role's gradient norm on its own, and the rest's (a critic's)
        together. Returns ``grad_norm``, the norm of all the gradients before clipping, and each role's
        ``role/<role>/grad_norm``."""
        tokens = loss_mask[mini_rows].sum(1)
        stepped = {self.rows[int(row)] for row, count in zip(mini_rows, tokens) if count > 0}
        for group in groups:
            if group.get("role") is not None and group["role"] not in stepped:
                for parameter in group["params"]:
                    parameter.grad = None
        parts = [(group.get("role"), group["params"]) for group in groups]
        norms = {role: clip_grad_norm(params, max_norm) for role, params in parts if role is not None}
        rest = [p for role, params in parts if role is None for p in params]
        total = math.sqrt(sum(norm**2 for norm in norms.values()) + clip_grad_norm(rest, max_norm) ** 2)
        return {"grad_norm": total, **{f"role/{role}/grad_norm": norm for role, norm in norms.items()}}
