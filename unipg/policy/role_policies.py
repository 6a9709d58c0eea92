"""A model per role of a multi-role task (``agent.role_policy: separate``): one ``LMPolicy`` per role.

Each role's policy is a whole model of its own, loaded from ``agent.roles.<role>.model`` (else ``model.name``), so
a small checker may sit beside a larger solver. They share one tokenizer (checked when they are loaded): episodes
render and tokenise every role's conversation with it, and a batch lays out every role's rows with its pad token.

The run's parts see ``RolePolicies`` where they would see one ``LMPolicy``:

- the engine samples a role's turns with ``for_role(role)`` (requests name their role, ``unipg.inference.hf``);
- the learner trains each role's policy on its role's rows alone (``unipg.learn.role_learners``);
- ``model`` is every role's model in one ``ModuleDict`` (keys ``<role>.<parameter>``), so the checkpointer saves and
  restores all of them as one state dict, and ``WeightSync`` publishes all of them to the rollout's copies;
- ``reference_model`` likewise holds every role's reference copy (None when the roles have none).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from unipg.policy.lm import LMPolicy


class RolePolicies:
    """The policies of a run's roles, by role, in the task's role order."""

    value_head = None  # no role has one: a value head or critic is refused (``separate_role_problems``)
    critic = None

    def __init__(self, policies: dict[str, LMPolicy]):
        if not policies:
            raise ValueError("RolePolicies needs the policy of at least one role")
        self.policies = policies
        self.model = nn.ModuleDict({role: policy.model for role, policy in policies.items()})
        first = next(iter(policies.values()))
        self.tokenizer, self.pad_id, self.eos_ids = first.tokenizer, first.pad_id, first.eos_ids
        lengths = [policy.context_length for policy in policies.values() if policy.context_length is not None]
        self.context_length = min(lengths) if lengths else None  # a turn must fit every role's model
        for role, policy in policies.items():
            check_same_tokenizer(first.tokenizer, policy.tokenizer, role)

    @property
    def roles(self) -> list[str]:
        return list(self.policies)

    def for_role(self, role: str | None) -> LMPolicy:
        """The policy that plays ``role``; a request without a role has none to go to."""
        if role not in self.policies:
            raise ValueError(
                f"with a model per role (agent.role_policy=separate) every request names its role; got {role!r}, "
                f"roles: {', '.join(self.policies)}"
            )
        return self.policies[role]

    @property
    def device(self) -> torch.device:
        return next(iter(self.policies.values())).device

    @property
    def reference_model(self) -> nn.Module | None:
        references = {role: policy.reference_model for role, policy in self.policies.items()}
        if any(reference is None for reference in references.values()):
            return None
        return nn.ModuleDict(references)

    def decode(self, ids: list[int]) -> str:
        return next(iter(self.policies.values())).decode(ids)

    def save(self, path: str | Path) -> Path:
        """Each role's model and tokenizer in ``path/<role>`` (``LMPolicy.save``: loadable as a plain HF model)."""
        path = Path(path)
        for role, policy in self.policies.items():
            policy.save(path / role)
        return path

    def inference_copy(self, device: torch.device | str | None = None) -> RolePolicies:
        """Sampling-only copies of every role's model (no reference), for the rollout side of the concurrent
        schedule (as ``unipg.runtime.backends.local_lm.inference_copy`` for one policy)."""
        copies = {}
        for role, policy in self.policies.items():
            model = copy.deepcopy(policy.model)
            copies[role] = LMPolicy(model if device is None else model.to(device), policy.tokenizer)
        return RolePolicies(copies)


def check_same_tokenizer(expected, tokenizer, role: str) -> None:
    """Refuse a role's tokenizer that differs from the first role's: one tokenizer renders every role's turns."""
    if tokenizer.get_vocab() != expected.get_vocab() or tokenizer.pad_token_id != expected.pad_token_id:
        raise ValueError(
            f"the model of role '{role}' has another tokenizer than the run's; with agent.role_policy=separate every "
            "role's model must share one tokenizer (the same vocabulary and pad token): set agent.roles."
            f"{role}.model to a model of the same family"
        )


def policy_for_role(policy, role: str | None) -> LMPolicy:
    """The policy that samples ``role``'s turns: that role's with a model per role, else ``policy`` itself."""
    return policy.for_role(role) if isinstance(policy, RolePolicies) else policy
