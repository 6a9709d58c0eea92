"""User code that registers tasks, tools, rewards, environments or estimators, imported before a config is checked.

A plugin is a module name (``my_package.tasks``, importable from ``sys.path``) or the path of a Python file
(``./my_tools.py``). Importing it runs its ``@TASKS.register(...)``-style decorators, so the names it adds are
valid when the config that uses them is validated. Plugins come from three places:

- ``plugins: [my_package.tasks, ./my_tools.py]`` in a config file; file paths are relative to the config
  file's folder (in a ``plugins=[...]`` override, to the working directory) and stored absolute, so a run
  folder's config.yaml finds them again;
- ``unipg --import MODULE`` on the command line (repeatable), added to the config's plugins;
- the ``unipg.plugins`` entry-point group of installed packages, loaded once per process::

      [project.entry-points."unipg.plugins"]
      my_tasks = "my_package.tasks"

Each plugin is imported once per process, whoever asks (the config loader, ``unipg.train``, a Ray worker
before it unpacks the task and tools it was sent). A file plugin is imported as the module
``unipg_plugin_<stem>_<hash of its path>``, the same name in every process, so that objects defined in it
pickle by reference; on a cluster of several machines a file plugin must therefore sit at the same path on each
of them (an installed package is the portable form). A plugin that fails to import (an exception, or
``sys.exit()``) is a ``ConfigError`` naming it and its exception.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import re
import sys
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType
from typing import Any

from unipg.config.section import ConfigError

ENTRY_POINT_GROUP = "unipg.plugins"
_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*", re.ASCII)


def is_file_plugin(plugin: str) -> bool:
    """Whether ``plugin`` names a Python file (ends in .py or holds a path separator) rather than a module."""
    return plugin.endswith(".py") or "/" in plugin or "\\" in plugin


def resolve_plugins(plugins: Any, base_dir: Path, where: str = "plugins") -> list[str]:
    """``plugins`` as a list of module names and absolute file paths (relative paths taken from ``base_dir``);
    a ConfigError when it is not a list of non-empty strings."""
    if plugins is None:
        return []
    if isinstance(plugins, str):
        plugins = [plugins]
    if not isinstance(plugins, list) or not all(isinstance(item, str) and item.strip() for item in plugins):
        raise ConfigError(
            f"{where} must be a list of module names or Python file paths, e.g. "
            f"[my_package.tasks, ./my_tools.py]; got {plugins!r}"
        )
    resolved = []
    for plugin in (item.strip() for item in plugins):
        if is_file_plugin(plugin):
            try:
                plugin = str((base_dir / Path(plugin).expanduser()).resolve())
            except (OSError, ValueError, RuntimeError) as error:  # a NUL byte, a symlink loop
                raise ConfigError(f"{where}: cannot read the path '{plugin}': {error}") from None
        elif not _MODULE_NAME.fullmatch(plugin):
            raise ConfigError(
                f"{where}: '{plugin}' is neither a module name (my_package.tasks) nor the path of a "
                "Python file (./my_tools.py)"
            )
        if plugin not in resolved:
            resolved.append(plugin)
    return resolved


def import_plugins(plugins: list[str] = ()) -> None:
    """Import the installed entry-point plugins (once per process), then each of ``plugins`` (each once)."""
    load_entry_point_plugins()
    for plugin in plugins:
        import_plugin(plugin)


@functools.lru_cache(maxsize=1)
def load_entry_point_plugins() -> tuple[str, ...]:
    """Load every entry point of the group ``unipg.plugins``: a module, or a callable that is then called with no
    arguments; returns their names."""
    names = []
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        try:
            loaded = entry.load()
            if callable(loaded) and not isinstance(loaded, ModuleType):
                loaded()
        except (Exception, SystemExit) as error:  # sys.exit() at import is a failed import too
            raise plugin_error(
                f"entry point '{entry.name} = {entry.value}' (group {ENTRY_POINT_GROUP})", error
            ) from error
        names.append(entry.name)
    return tuple(names)


def import_plugin(plugin: str) -> ModuleType:
    """The module of ``plugin`` (a module name or an absolute file path), imported on first use."""
    if not is_file_plugin(plugin):
        if plugin in sys.modules:
            return sys.modules[plugin]
        try:
            return importlib.import_module(plugin)
        except (Exception, SystemExit) as error:  # sys.exit() at import is a failed import too
            missing = getattr(error, "name", None) if isinstance(error, ModuleNotFoundError) else None
            hint = "; is it installed, or on PYTHONPATH?" if missing and plugin.startswith(missing) else ""
            raise plugin_error(f"'{plugin}'", error, hint) from error
    path = Path(plugin)
    name = file_module_name(path)
    if name in sys.modules:
        return sys.modules[name]
    if not path.is_file():
        raise ConfigError(
            f"plugin file '{path}' does not exist; plugin paths in a config file are relative to that file's folder"
        )
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as error:
        del sys.modules[name]
        raise plugin_error(f"file '{path}'", error) from error
    return module


def file_module_name(path: Path) -> str:
    """The module name a file plugin is imported as: the same for the same absolute path in every process."""
    stem = re.sub(r"\W", "_", path.stem)
    return f"unipg_plugin_{stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"


def plugin_error(what: str, error: BaseException, hint: str = "") -> ConfigError:
    if isinstance(error, SystemExit):
        return ConfigError(
            f"plugin {what} called sys.exit({error.code!r}) while it was imported; a plugin only defines and "
            'registers things: move its script part under `if __name__ == "__main__":`'
        )
    lines = str(error).strip().splitlines()
    reason = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return ConfigError(f"plugin {what} failed to import: {reason}{hint}")


def imported_first(plugins: list[str], payload: Any) -> Any:
    """``payload`` wrapped so that unpickling it in another process (a Ray actor) first imports ``plugins``, then
    rebuilds ``payload`` itself: the tasks, tools and rewards it holds may be defined in those plugins."""
    return _ImportedFirst(tuple(plugins), payload)


class _ImportedFirst:
    def __init__(self, plugins: tuple[str, ...], payload: Any):
        self.plugins, self.payload = plugins, payload

    def __reduce__(self):
        # pickle rebuilds a reduction's arguments in order, so the reduction of _Imports (the import) runs before
        # any object of the payload is looked up; unpickling returns the payload itself.
        return (_payload, (_Imports(self.plugins), self.payload))


class _Imports:
    def __init__(self, plugins: tuple[str, ...]):
        self.plugins = plugins

    def __reduce__(self):
        return (_import_for_unpickling, (self.plugins,))


def _import_for_unpickling(plugins: tuple[str, ...]) -> None:
    import_plugins(list(plugins))


def _payload(imported: None, payload: Any) -> Any:
    return payload
