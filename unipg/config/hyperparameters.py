"""Which estimator hyperparameters the chosen estimators read, derived from the registries of ``unipg.estimate``.

Section ``estimator`` holds selectors (``advantage``, ``policy_loss``, ``off_policy_weight``, ``kl_estimator``),
each naming an entry of a registry, and hyperparameters. A hyperparameter that some entry of a registry declares
as an option (``clip_range`` of the policy loss 'ppo') has an effect only when the selector picks an entry that
declares it; every other field of the section (``entropy_coef``, ``kl_coef``, ...) is read whatever the choice.
The registries are the one place that says which estimator reads what: this module only reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from unipg.config.schema import EstimatorConfig
from unipg.estimate import (
    ADVANTAGES,
    KL_ESTIMATORS,
    OFF_POLICY_WEIGHTS,
    POLICY_LOSSES,
    Registry,
)
from unipg.estimate.trpo import TRUST_REGION_STEPS


@dataclass(frozen=True)
class Choice:
    """A selector field of section ``estimator`` and the registries its value names an entry of."""

    selector: str
    kind: str
    registries: tuple[Registry, ...]

    def names(self) -> list[str]:
        return sorted(name for registry in self.registries for name in registry.names())

    def registry_of(self, name: str) -> Registry | None:
        return next((registry for registry in self.registries if name in registry), None)

    def options(self, name: str) -> list[str]:
        """The hyperparameters entry ``name`` reads (none for an unknown name)."""
        registry = self.registry_of(name)
        return registry.options(name) if registry is not None else []

    def readers(self) -> dict[str, list[str]]:
        """hyperparameter → the entries that read it."""
        readers: dict[str, list[str]] = {}
        for name in self.names():
            for option in self.options(name):
                readers.setdefault(option, []).append(name)
        return readers


CHOICES: tuple[Choice, ...] = (
    Choice("advantage", "advantage estimator", (ADVANTAGES,)),
    Choice("policy_loss", "policy loss", (POLICY_LOSSES, TRUST_REGION_STEPS)),
    Choice("off_policy_weight", "off-policy weight", (OFF_POLICY_WEIGHTS,)),
    Choice("kl_estimator", "KL estimator", (KL_ESTIMATORS,)),
)


def governed() -> dict[str, tuple[Choice, list[str]]]:
    """hyperparameter → (the choice it belongs to, the entries that read it)."""
    return {option: (choice, names) for choice in CHOICES for option, names in choice.readers().items()}


def general_settings() -> list[str]:
    """Fields of section ``estimator`` read whatever the estimators chosen: neither selectors nor options."""
    owned = set(governed()) | {choice.selector for choice in CHOICES}
    return [name for name in EstimatorConfig.model_fields if name not in owned]


def default(name: str) -> Any:
    """The default of field ``name`` of section ``estimator``."""
    return EstimatorConfig.model_fields[name].get_default(call_default_factory=True)


def chosen_estimators(estimator: Mapping[str, Any] | object) -> dict[str, str]:
    """selector → chosen entry, read from a mapping (missing or non-text values: the field's default) or a
    section object."""

    def read(key: str) -> str:
        if not isinstance(estimator, Mapping):
            return getattr(estimator, key)
        return estimator[key] if isinstance(estimator.get(key), str) else default(key)

    return {choice.selector: read(choice.selector) for choice in CHOICES}


def accepted_phrase(chosen: Mapping[str, str]) -> str:
    """What the chosen estimators accept, e.g. "The chosen estimators accept: advantage estimator 'gae':
    gamma, lambda_gae; policy loss 'ppo': clip_range, ...; and whatever the choice: entropy_coef, ..."."""
    parts = []
    for choice in CHOICES:
        name = chosen[choice.selector]
        parts.append(f"{choice.kind} '{name}': {', '.join(choice.options(name)) or 'no options'}")
    return f"The chosen estimators accept: {'; '.join(parts)}; and whatever the choice: {', '.join(general_settings())}"


def unread_hyperparameters(estimator: object, user_keys: set[str]) -> dict[str, str]:
    """A warning for each ``estimator.*`` key the user set that no chosen estimator reads: the hyperparameter of
    an entry other than the one chosen (``dual_clip`` with policy_loss vanilla), keyed by the dotted key."""
    chosen = chosen_estimators(estimator)
    warnings = {}
    for option, (choice, readers) in governed().items():
        key = f"estimator.{option}"
        if key in user_keys and option not in choice.options(chosen[choice.selector]):
            governing = f"estimator.{choice.selector}"
            warnings[key] = (
                f"'{key}' has no effect unless {governing} is {' or '.join(readers)} "
                f"({choice.kind} '{chosen[choice.selector]}' does not read it); remove it or set "
                f"{governing}"
            )
    return warnings
