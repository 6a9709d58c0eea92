"""Every rollout backend implements the whole ``Rollout`` protocol the drivers use, with the same parameters.

Checked on the classes, so the Ray backend is checked without starting Ray."""

from __future__ import annotations

import inspect

import pytest

from unipg.runtime.backends.local_gym import GymSegments
from unipg.runtime.backends.local_lm import LMRollout
from unipg.runtime.driver import Rollout


def protocol_members() -> list[str]:
    return sorted(name for name, value in vars(Rollout).items() if not name.startswith("_") and callable(value))


def backends() -> list[type]:
    classes = [GymSegments, LMRollout]
    try:
        from unipg.runtime.backends.ray_lm import RayRollout
    except (ImportError, ValueError):  # Ray is not installed: the two in-process backends are still checked
        return classes
    return [*classes, RayRollout]


def test_the_protocol_declares_what_the_drivers_call():
    assert protocol_members() == sorted([
        "produce", "serve", "publish", "pop_idle_seconds", "pop_generation", "pop_service_metrics",
        "pop_sync_seconds", "episode_state", "resume_episodes", "close"])


@pytest.mark.parametrize("backend", backends(), ids=lambda cls: cls.__name__)
def test_each_backend_implements_every_member_with_the_protocols_parameters(backend):
    for name in protocol_members():
        implementation = getattr(backend, name, None)
        assert callable(implementation), f"{backend.__name__} lacks {name}"
        expected = list(inspect.signature(getattr(Rollout, name)).parameters)
        assert list(inspect.signature(implementation).parameters) == expected, f"{backend.__name__}.{name}"
        assert inspect.getdoc(implementation), f"{backend.__name__}.{name} says what it returns"


def test_a_gym_rollout_reports_the_neutral_values():
    segments = GymSegments.__new__(GymSegments)
    segments.sync = None
    assert segments.pop_generation() == ([], 0.0)
    assert segments.pop_service_metrics("rollout") == {}
    assert segments.pop_sync_seconds() is None and segments.episode_state() is None
    segments.resume_episodes({"started": 4})
    segments.close()
