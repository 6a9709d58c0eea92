"""The learner's side of ``agent.role_policy: separate``: a model per role, each trained by a learner of its own.

``RoleLearners`` has the interface the runtime uses of an ``LMLearner`` (``prepare``, ``update``, the learning-rate
fraction and factor, ``checkpoint`` and ``restore``) and holds one ``LMLearner`` per role, each over its role's
policy (``unipg.policy.role_policies``), with its own optimizer state, reference, KL controller and mini-batch
shuffling. A batch's rows are split by role (``Trajectory.role``, the ``roles`` argument) and each role's learner
runs on its rows alone, so:

- a role's model moves only from its own rows' loss; a role none of whose rows has a loss token (it never acted)
  is not stepped at all, so its weights and optimizer state stay as they are (AdamW's weight decay would otherwise
  move them);
- each role's advantages are estimated on its rows (the group estimators compare a role's samples of one prompt,
  as with one shared model, ``unipg.runtime.lm.group_index``), and each role's mini-batches are
  ``train.mini_batch_size`` of its own rows;
- each role's metrics are logged as ``role/<role>/<metric>`` (loss, KL, entropy, grad norm, ...; and from
  ``prepare`` its rows' ``reward_mean`` and, for off-policy rows, ``staleness_mean``); the unprefixed metrics are
  their mean over the roles that were stepped (``skipped_steps`` their sum, ``reverted`` their maximum).
"""

from __future__ import annotations

import statistics

import torch

from unipg.config import Config
from unipg.learn.lm import LMBatch, LMLearner
from unipg.policy.role_policies import RolePolicies

SUMMED = {"skipped_steps"}  # metrics whose run-wide value is the roles' sum, not their mean
WORST = {"reverted"}  # ... their maximum


class RoleLearners:
    """One ``LMLearner`` per role of a ``RolePolicies``, fed the rows of its role (module docstring)."""

    def __init__(self, policy: RolePolicies, config: Config):
        self.policy, self.config = policy, config
        self.learners = {role: LMLearner(own, config) for role, own in policy.policies.items()}
        self._parts: tuple[LMBatch, dict[str, LMBatch]] | None = None  # the batch ``prepare`` split, by role

    def split(self, batch: LMBatch, roles: list[str] | None) -> dict[str, LMBatch]:
        """The sub-batch of each role's rows of ``batch`` (roles without a row are left out)."""
        if roles is None or len(roles) != len(batch.scores):
            raise ValueError("with a model per role the learner needs the role of every row of the batch (roles=...)")
        unknown = sorted(set(roles) - set(self.learners))
        if unknown:
            raise ValueError(f"rows of role(s) {', '.join(unknown)}, which have no model (roles: {self.policy.roles})")
        parts = {}
        for role in self.learners:
            index = torch.tensor([row for row, own in enumerate(roles) if own == role], dtype=torch.long)
            if len(index):
                parts[role] = batch.rows(index.to(batch.scores.device))
        return parts

    def prepare(self, batch: LMBatch, roles: list[str] | None = None) -> dict[str, float]:
        """Each role's ``LMLearner.prepare`` on its rows (reference log-probs, advantages); its metrics under
        ``role/<role>/``, with its rows' mean reward and staleness, and the roles' mean unprefixed."""
        parts = self.split(batch, roles)
        self._parts = (batch, parts)
        per_role = {}
        for role, part in parts.items():
            metrics = self.learners[role].prepare(part)
            metrics["reward_mean"] = float(part.scores.mean())
            if part.ages is not None:
                mask = part.completion_mask
                metrics["staleness_mean"] = float((part.ages * mask).sum() / mask.sum().clamp(min=1))
            per_role[role] = metrics
        return combined(per_role, exclude=("reward_mean", "staleness_mean"))

    def update(self, batch: LMBatch, roles: list[str] | None = None) -> dict[str, float]:
        """Each role's ``LMLearner.update`` on the rows ``prepare`` gave it, but for roles without a loss token
        (not stepped at all); metrics as ``prepare``'s. ``batch`` must be the one ``prepare`` was given."""
        if self._parts is None or self._parts[0] is not batch:
            raise ValueError("RoleLearners.update learns from the batch of the last prepare; call prepare(batch) first")
        mask_truncated = self.config.estimator.mask_truncated_completions
        per_role = {}
        for role, part in self._parts[1].items():
            if float(part.loss_mask(mask_truncated).sum()) > 0:
                per_role[role] = self.learners[role].update(part)
        self._parts = None
        return combined(per_role)

    def set_lr_fraction(self, fraction: float) -> float:
        """Every role's learning rate at ``fraction`` of its base rate; returns the first role's."""
        rates = [learner.set_lr_fraction(fraction) for learner in self.learners.values()]
        return rates[0]

    @property
    def lr_factor(self) -> float:
        return next(iter(self.learners.values())).lr_factor

    @lr_factor.setter
    def lr_factor(self, factor: float) -> None:  # a rollback lowers every role's rate alike
        for learner in self.learners.values():
            learner.lr_factor = factor

    def checkpoint(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Every role's optimizer tensors, named ``<role>.<name>``, and as JSON each role's learner state."""
        tensors, states = {}, {}
        for role, learner in self.learners.items():
            own, states[role] = learner.checkpoint()
            tensors.update({f"{role}.{name}": tensor for name, tensor in own.items()})
        return tensors, {"roles": states}

    def restore(self, tensors: dict[str, torch.Tensor], state: dict) -> None:
        """Set every role's learner back to a state from ``checkpoint``."""
        if set(state.get("roles", {})) != set(self.learners):
            raise ValueError(
                f"the checkpoint's roles ({', '.join(state.get('roles', {})) or 'none: one model'}) are not the "
                f"run's ({', '.join(self.learners)}); the run's agent.role_policy setting changed since it was saved"
            )
        for role, learner in self.learners.items():
            prefix = f"{role}."
            own = {name.removeprefix(prefix): tensor for name, tensor in tensors.items() if name.startswith(prefix)}
            learner.restore(own, state["roles"][role])

    def close(self) -> None:
        for learner in self.learners.values():
            learner.close()


def combined(per_role: dict[str, dict[str, float]], exclude: tuple[str, ...] = ()) -> dict[str, float]:
    """Each role's metrics as ``role/<role>/<name>``, and each name (but ``exclude``) over the roles: its mean,
    the sum for ``SUMMED`` and the maximum for ``WORST``."""
    metrics = {f"role/{role}/{name}": value for role, own in per_role.items() for name, value in own.items()}
    names = {name for own in per_role.values() for name in own if name not in exclude}
    for name in sorted(names):
        values = [own[name] for own in per_role.values() if name in own]
        metrics[name] = sum(values) if name in SUMMED else max(values) if name in WORST else statistics.fmean(values)
    return metrics
