"""KL-penalty coefficient controllers: how strongly the loss pulls π_θ back towards the reference policy.

The learner adds coef · KL(π_θ ‖ π_ref) to the loss (or subtracts it from the reward) and, after each
step, reports the KL it observed with ``update(observed_kl, n_steps)``. A fixed controller ignores the
report; the adaptive one (Ziegler et al. 2019) nudges the coefficient so the KL tracks a target.
Both save and restore their state as plain floats so a checkpoint resumes with the same coefficient.
"""

from __future__ import annotations

from typing import Protocol

import torch

from unipg.registry import unknown_name_message


class KLController(Protocol):
    """What the learner needs from a KL controller."""

    coef: float

    def update(self, observed_kl: float | torch.Tensor, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, float]: ...

    def load_state_dict(self, state: dict[str, float]) -> None: ...


def _check_coef(coef: float) -> float:
    coef = float(coef)
    if not coef >= 0:
        raise ValueError(f"KL coefficient ({coef}) must be ≥ 0; 0 disables the KL penalty")
    return coef


class FixedKLController:
    """coef stays what it was set to; ``update`` is a no-op."""

    def __init__(self, coef: float):
        self.coef = _check_coef(coef)

    def update(self, observed_kl: float | torch.Tensor, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef = _check_coef(state["coef"])


class AdaptiveKLController:
    """Proportional control of the KL coefficient (Ziegler et al. 2019, "Fine-Tuning Language Models
    from Human Preferences", §2.2):

        e = clip(KL / target_kl − 1, −0.2, 0.2)
        coef ← coef · (1 + e · n_steps / horizon)

    So the coefficient moves at most ±20% per ``horizon`` steps: up while KL is above target, down below.
    """

    def __init__(self, init_coef: float, *, target_kl: float, horizon: float):
        if target_kl is None or not target_kl > 0:
            raise ValueError(f"target_kl ({target_kl}) must be > 0; it is the KL the controller steers towards")
        if not horizon > 0:
            raise ValueError(f"horizon ({horizon}) must be > 0; it is the number of steps for a ±20% change")
        self.coef = _check_coef(init_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, observed_kl: float | torch.Tensor, n_steps: int) -> None:
        if n_steps < 0:
            raise ValueError(f"n_steps ({n_steps}) must be ≥ 0")
        proportional_error = min(max(float(observed_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        # target_kl and horizon come from the configuration; only the coefficient evolves.
        return {"coef": self.coef}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef = _check_coef(state["coef"])


KL_CONTROLLER_KINDS = ("adaptive", "fixed")


def make_kl_controller(
    kind: str, *, coef: float, target_kl: float | None = None, horizon: float = 10000
) -> FixedKLController | AdaptiveKLController:
    """Build the controller named ``kind``: "fixed" (coef) or "adaptive" (coef, target_kl, horizon)."""
    if kind == "fixed":
        return FixedKLController(coef)
    if kind == "adaptive":
        if target_kl is None:
            raise ValueError("the adaptive KL controller needs target_kl (e.g. 0.02); set it or use kind='fixed'")
        return AdaptiveKLController(coef, target_kl=target_kl, horizon=horizon)
    raise ValueError(unknown_name_message("KL controller", kind, list(KL_CONTROLLER_KINDS)))
