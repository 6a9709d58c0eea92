"""KL coefficient controllers: fixed stays put, adaptive tracks the target within ±20% per horizon."""

import pytest
import torch

from unipg.estimate.kl_control import (
    AdaptiveKLController,
    FixedKLController,
    make_kl_controller,
)


def test_fixed_controller_never_changes():
    controller = FixedKLController(0.05)
    for observed_kl in (0.0, 0.5, 100.0):
        controller.update(observed_kl, n_steps=1000)
    assert controller.coef == 0.05


def test_adaptive_coef_rises_when_kl_above_target_and_falls_below():
    controller = AdaptiveKLController(0.1, target_kl=0.02, horizon=100)
    controller.update(0.021, n_steps=10)  # e = 0.05 → coef · (1 + 0.05 · 10/100)
    assert controller.coef == pytest.approx(0.1 * 1.005)
    controller = AdaptiveKLController(0.1, target_kl=0.02, horizon=100)
    controller.update(0.016, n_steps=10)  # e = −0.2 → coef · (1 − 0.2 · 0.1)
    assert controller.coef == pytest.approx(0.1 * 0.98)
    controller = AdaptiveKLController(0.1, target_kl=0.02, horizon=100)
    controller.update(torch.tensor(0.02), n_steps=10)  # on target: unchanged; tensors are accepted
    assert controller.coef == pytest.approx(0.1)


def test_adaptive_change_is_clipped_to_twenty_percent_per_horizon():
    far_above = AdaptiveKLController(0.1, target_kl=0.02, horizon=100)
    far_above.update(2.0, n_steps=100)  # KL/target − 1 = 99, clipped to +0.2
    assert far_above.coef == pytest.approx(0.12)
    far_below = AdaptiveKLController(0.1, target_kl=0.02, horizon=100)
    far_below.update(0.0, n_steps=100)  # −1 clipped to −0.2
    assert far_below.coef == pytest.approx(0.08)
    partial = AdaptiveKLController(0.1, target_kl=0.02, horizon=100)
    partial.update(2.0, n_steps=25)  # a quarter of the horizon → a quarter of the change
    assert partial.coef == pytest.approx(0.105)


def test_state_dict_round_trip_restores_coefficient():
    controller = AdaptiveKLController(0.1, target_kl=0.02, horizon=100)
    controller.update(1.0, n_steps=50)
    state = controller.state_dict()
    assert all(isinstance(value, float) for value in state.values())
    restored = AdaptiveKLController(0.1, target_kl=0.02, horizon=100)
    restored.load_state_dict(state)
    assert restored.coef == controller.coef
    fixed = FixedKLController(0.3)
    fresh = FixedKLController(0.0)
    fresh.load_state_dict(fixed.state_dict())
    assert fresh.coef == 0.3


def test_make_kl_controller_builds_each_kind():
    fixed = make_kl_controller("fixed", coef=0.05)
    assert isinstance(fixed, FixedKLController) and fixed.coef == 0.05
    adaptive = make_kl_controller("adaptive", coef=0.05, target_kl=0.02, horizon=500)
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.coef, adaptive.target_kl, adaptive.horizon) == (0.05, 0.02, 500.0)


def test_make_kl_controller_errors_name_the_fix():
    with pytest.raises(ValueError, match="did you mean 'adaptive'.*fixed"):
        make_kl_controller("adaptiv", coef=0.05)
    with pytest.raises(ValueError, match="target_kl"):
        make_kl_controller("adaptive", coef=0.05)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: AdaptiveKLController(0.1, target_kl=0.0, horizon=100), "target_kl"),
        (lambda: AdaptiveKLController(0.1, target_kl=0.02, horizon=0), "horizon"),
        (lambda: AdaptiveKLController(-0.1, target_kl=0.02, horizon=100), "≥ 0"),
        (lambda: FixedKLController(-1.0), "≥ 0"),
    ],
)
def test_invalid_settings_are_rejected(build, message):
    with pytest.raises(ValueError, match=message):
        build()
