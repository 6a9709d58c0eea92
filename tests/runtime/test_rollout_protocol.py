"""Every registered rollout backend implements the whole ``Rollout`` protocol the drivers use, with the same
parameters, and so does the gymnasium driver's own rollout.

Checked on the classes the backend factories name as their return annotation, so the Ray backend is checked
without starting Ray."""

from __future__ import annotations

import ast
import inspect
import sys
import typing

import pytest

from unipg.runtime.backends import BACKEND_INPUTS, BACKENDS
from unipg.runtime.backends.local_gym import GymSegments
from unipg.runtime.driver import Rollout


def protocol_members() -> list[str]:
    return sorted(name for name, value in vars(Rollout).items() if not name.startswith("_") and callable(value))


def rollout_class(backend: str) -> type:
    """The class backend ``backend``'s factory returns: its return annotation, resolved in the factory's module with
    the names that module imports under ``if TYPE_CHECKING:`` (where a lazily built class is named)."""
    factory = BACKENDS.get(backend)
    module = sys.modules[factory.__module__]
    namespace = dict(vars(module))
    for node in ast.parse(inspect.getsource(module)).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            exec(compile(ast.Module(node.body, type_ignores=[]), module.__file__, "exec"), namespace)
    returned = typing.get_type_hints(factory, globalns=namespace).get("return")
    assert isinstance(returned, type), (
        f"backend '{backend}': annotate its factory's return type with the Rollout "
        f"class it builds, e.g. def {factory.__name__}(...) -> MyRollout"
    )
    return returned


def rollout_classes() -> list:
    """The class of every registered backend, and the gymnasium driver's ``GymSegments``."""
    classes = [pytest.param(GymSegments, id="gym:GymSegments")]
    for backend in BACKENDS.names():
        try:
            classes.append(pytest.param(rollout_class(backend), id=f"{backend}:{BACKENDS.get(backend).__name__}"))
        except ImportError as error:  # an optional dependency (Ray) is not installed
            classes.append(pytest.param(None, id=backend, marks=pytest.mark.skip(reason=str(error))))
    return classes


def test_every_backend_takes_the_inputs_the_driver_hands_it():
    for backend in BACKENDS.names():
        assert BACKENDS.entry(backend).inputs == BACKEND_INPUTS, backend


def test_the_protocol_declares_what_the_drivers_call():
    assert protocol_members() == sorted(["produce", "serve", "publish", "report", "resume_episodes", "close"])


@pytest.mark.parametrize("backend", rollout_classes())
def test_each_backend_implements_every_member_with_the_protocols_parameters(backend):
    for name in protocol_members():
        implementation = getattr(backend, name, None)
        assert callable(implementation), f"{backend.__name__} lacks {name}"
        expected = list(inspect.signature(getattr(Rollout, name)).parameters)
        assert list(inspect.signature(implementation).parameters) == expected, f"{backend.__name__}.{name}"
        assert inspect.getdoc(implementation), f"{backend.__name__}.{name} says what it returns"


def test_a_gym_rollout_reports_the_neutral_values():
    segments = GymSegments.__new__(GymSegments)
    segments.sync, segments._since, segments._busy = None, 0.0, 0.0
    report = segments.report()
    assert report.batch_sizes == [] and report.generate_seconds == 0.0 and report.counters == {}
    assert report.sync_seconds is None and report.episodes is None and report.metrics() == {}
    segments.resume_episodes({"started": 4})
    segments.close()
