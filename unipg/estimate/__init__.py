"""Q2 — how the gradient is estimated: pure tensor functions and their registries.

Layout convention: batch first, time last — every per-step tensor is (B, T) with a ``mask`` of the same
shape that is 1 on valid steps/tokens and 0 on padding.
"""

from unipg.estimate.advantages import (
    ADVANTAGES,
    advantage_family,
    advantage_names,
    needs_critic,
    needs_greedy_baseline,
)
from unipg.estimate.kl import KL_ESTIMATORS
from unipg.estimate.losses import POLICY_LOSSES, LossOutput
from unipg.estimate.weights import OFF_POLICY_WEIGHTS, OffPolicyWeights
from unipg.registry import Registry, RegistryError

# Estimators beyond the classic ones register on import: sequence-level ratios, shaped weights, covariance
# selection (policy losses), more group baselines and a per-token one (advantages).
from unipg.estimate import (  # noqa: E402, F401  isort: skip
    covariance_losses,
    gated_losses,
    group_advantages,
    sequence_losses,
    token_baselines,
)

__all__ = [
    "ADVANTAGES",
    "KL_ESTIMATORS",
    "OFF_POLICY_WEIGHTS",
    "POLICY_LOSSES",
    "LossOutput",
    "OffPolicyWeights",
    "Registry",
    "RegistryError",
    "advantage_family",
    "advantage_names",
    "needs_critic",
    "needs_greedy_baseline",
]
