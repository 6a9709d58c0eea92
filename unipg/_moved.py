"""Module paths that moved, kept importable for one release with a warning that names the new import.

Plugins written against an earlier layout (``from unipg.sample.tasks import TASKS, Example, Task``) keep working:
importing an old path gives the module now at the new path, under the old name, and warns once per path with
``UnipgDeprecationWarning``. New code imports the public surface: ``unipg`` itself, or ``unipg.tasks``,
``unipg.tools``, ``unipg.envs``, ``unipg.inference``, ``unipg.estimate`` and ``unipg.runtime``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old module path → new module path; a submodule of an old path moves with it (``old.base`` → ``new.base``)
MOVED = {
    "unipg.sample.tasks": "unipg.tasks",
    "unipg.sample.agent_tasks": "unipg.tasks.calculator",
    "unipg.sample.multihop": "unipg.tasks.multihop",
    "unipg.sample.rewards": "unipg.tasks.rewards",
    "unipg.sample.reward_model": "unipg.tasks.rewards.model",
    "unipg.sample.answers": "unipg.tasks.answers",
    "unipg.sample.tools.formats": "unipg.policy.tool_calls",
    "unipg.sample.tools": "unipg.tools",
    "unipg.sample.bounded": "unipg.tools.bounded",
    "unipg.sample.envs": "unipg.envs",
    "unipg.sample.engines": "unipg.inference",
    "unipg.sample.inference": "unipg.inference",
    "unipg.sample.endpoint.agents": "unipg.sample.endpoint_agents",
    "unipg.sample.endpoint": "unipg.inference.endpoint",
    "unipg.sample.replay": "unipg.runtime.replay",
    "unipg.estimate.registry": "unipg.registry",
    "unipg.presets": "unipg.config.presets",
}


class UnipgDeprecationWarning(FutureWarning):
    """A path or name that still works and will be removed in the next release (shown by default: it is meant
    for the people who wrote the plugin, not only for the test suite)."""


def new_path(old: str) -> str | None:
    """Where module ``old`` lives now, or None if it did not move."""
    for moved in sorted(MOVED, key=len, reverse=True):
        if old == moved or old.startswith(moved + "."):
            return MOVED[moved] + old[len(moved) :]
    return None


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that points ``warnings.warn`` at the importing line: frames of this module count,
    the import machinery's frames do not (``warnings`` skips them itself)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    return level


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an old path with the module at its new path (the same object, so registries are shared)."""

    def find_spec(self, fullname, path=None, target=None):
        if new_path(fullname) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = new_path(spec.name)
        warnings.warn(
            f"'{spec.name}' moved to '{new}'; import from '{new}' (or the public names of 'unipg', "
            f"'unipg.tasks', 'unipg.tools', 'unipg.envs', 'unipg.inference'): the old path goes in the "
            "next release",
            UnipgDeprecationWarning,
            stacklevel=_caller_stacklevel(),
        )
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        pass  # the module at the new path is already executed


def install() -> None:
    """Put the finder first on ``sys.meta_path``, once."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())  # before the path finder: a moved
        # package's submodules (``unipg.sample.tasks.base``) must not load a second time from the new folder
