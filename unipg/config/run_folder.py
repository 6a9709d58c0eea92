"""A run folder is data: reading its config.yaml, to evaluate or to resume the run, runs no code the folder names.

A folder may come from someone else (a colleague, a download), and a configuration can name code in five places:

- ``plugins``: modules and Python files imported before the config is checked;
- ``task.agent``: an agent's module or file, imported and run for every episode;
- a tool server (``{name: mcp, server: {command: ..., args: [...]}}``, anywhere in the tree): a command started;
- ``ray.runtime_env`` beyond its environment variables (``pip``, ``py_modules``, ``working_dir``, setup hooks):
  packages installed and code shipped to every worker;
- ``model.trust_remote_code``: Python files of the model folder run when the model loads.

A sixth setting weakens where code runs: a tool's ``isolation`` other than ``kernel`` (the Python sandbox without
its namespaces), which would let the policy's code, itself part of what was received, read and write this
machine's files; and ``endpoint.allow_remote``, which serves the run's endpoint to other machines. Both are treated
as code.

``read_run_folder`` takes each of them only when the user names it again (an override of the same key, or of a
section above it; ``--import`` for a plugin), or passes ``trust_code`` (``--trust-folder-code``) for a folder they
made or trust. Otherwise the plugins and the remote code are left out, and a notice says which: the run may not
need them (a plugin installed as an entry point loads anyway; most models load without their own code). The
others define what the run does, so evaluating or resuming it without them would be another run: a
``ConfigError`` names them and the ways to go on.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unipg.config.loading import load_config, parse_override
from unipg.config.plugins import resolve_plugins
from unipg.config.schema import Config
from unipg.config.section import ConfigError
from unipg.config.yaml_file import read_yaml

TRUST_FLAG = "--trust-folder-code"
RUNTIME_ENV_DATA = ("env_vars", "config", "excludes")
"""The keys of a Ray ``runtime_env`` that name no code; every other key installs or ships some."""


@dataclass(frozen=True)
class FolderCode:
    """One place where a run folder's configuration names code: its dotted key, what it would run, and whether
    the run is another one without it."""

    key: str
    shown: str
    defines_run: bool

    def describe(self) -> str:
        return f"{self.key} ({self.shown})"


def folder_code(tree: dict[str, Any], run_dir: Path) -> list[FolderCode]:
    """Every place in ``tree`` (a run folder's config.yaml) that names code, in the order of the list above."""
    found = []
    plugins = tree.get("plugins")
    if plugins:
        for plugin in plugins if isinstance(plugins, list) else [plugins]:
            found.append(FolderCode("plugins", _plugin_shown(plugin, run_dir), defines_run=False))
    task = tree.get("task")
    if isinstance(task, dict) and task.get("agent"):
        found.append(FolderCode("task.agent", str(task["agent"]), defines_run=True))
    found.extend(_tool_servers(tree, []))
    runtime_env = (tree.get("ray") or {}).get("runtime_env") if isinstance(tree.get("ray"), dict) else None
    if isinstance(runtime_env, dict):
        for key in runtime_env:
            if key not in RUNTIME_ENV_DATA:
                found.append(FolderCode(f"ray.runtime_env.{key}", str(runtime_env[key])[:80], defines_run=True))
    endpoint = tree.get("endpoint")
    if isinstance(endpoint, dict) and endpoint.get("allow_remote") is True:
        shown = f"serves the endpoint at {endpoint.get('host')!r} to other machines"
        found.append(FolderCode("endpoint.allow_remote", shown, defines_run=True))
    model = tree.get("model")
    if isinstance(model, dict) and model.get("trust_remote_code") is True:
        found.append(FolderCode("model.trust_remote_code", "true", defines_run=False))
    return found


def _plugin_shown(plugin: Any, run_dir: Path) -> str:
    try:
        return resolve_plugins([plugin], run_dir)[0]
    except (ConfigError, IndexError):
        return repr(plugin)


def _tool_servers(node: Any, path: list[str]) -> list[FolderCode]:
    """The tool servers (a ``server`` mapping holding a ``command``) and the sandboxes without kernel isolation
    (an ``isolation`` other than ``kernel``) anywhere under ``node``."""
    found = []
    if isinstance(node, dict):
        server = node.get("server")
        if isinstance(server, dict) and "command" in server:
            command = " ".join(str(part) for part in [server["command"], *(server.get("args") or [])])
            found.append(FolderCode(_dotted([*path, "server"]), command[:120], defines_run=True))
        if "isolation" in node and node["isolation"] != "kernel":
            shown = f"{node['isolation']!r}: the sandbox without its namespaces"
            found.append(FolderCode(_dotted([*path, "isolation"]), shown, defines_run=True))
        for key, value in node.items():
            if key != "server":
                found.extend(_tool_servers(value, [*path, str(key)]))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found.extend(_tool_servers(value, [*path[:-1], f"{path[-1]}[{index}]"] if path else [f"[{index}]"]))
    return found


def _dotted(parts: list[str]) -> str:
    return ".".join(parts)


def _named_by(entry: FolderCode, override_keys: list[str], imported: list[str]) -> bool:
    """Whether the user names ``entry`` again: an override of its key or of a section above it, or, for a plugin,
    ``--import`` of the same module or file."""
    key = entry.key.split("[")[0]
    if any(key == named or key.startswith(f"{named}.") for named in override_keys):
        return True
    return entry.key == "plugins" and entry.shown in imported


def _in_unread(entry: FolderCode, unread: tuple[str, ...]) -> bool:
    """Whether ``entry`` lies in a section the caller never uses. Plugins are imported whoever reads the config, and
    the endpoint serves an external agent's evaluation as it serves its training."""
    section = entry.key.split(".")[0].split("[")[0]
    return section not in ("plugins", "endpoint") and section in unread


def _without(tree: dict[str, Any], skipped: list[FolderCode], run_dir: Path) -> dict[str, Any]:
    """``tree`` without the plugins and the remote code in ``skipped`` (the entries that define the run are
    refused before this, never removed)."""
    tree = copy.deepcopy(tree)
    dropped = {entry.shown for entry in skipped if entry.key == "plugins"}
    if dropped:
        kept = [plugin for plugin in tree.get("plugins") or [] if _plugin_shown(plugin, run_dir) not in dropped]
        tree["plugins"] = kept
    if any(entry.key == "model.trust_remote_code" for entry in skipped):
        tree["model"]["trust_remote_code"] = False
    return tree


def read_run_folder(
    run_dir: Path,
    overrides: list[str],
    *,
    plugins: list[str] | None = None,
    unread: tuple[str, ...] = (),
    trust_code: bool = False,
    notify: Callable[[str], None],
    check: Callable[[Config], None] = lambda config: None,
) -> Config:
    """The configuration in ``run_dir``/config.yaml with ``overrides`` and ``plugins`` applied, without the code
    the folder names (the module docstring says which, and when it is taken after all); ``notify`` receives one
    line naming what was left out, and a ``ConfigError`` of ``check`` (the registries' names and options) says it
    too, since the code left out may be what registers them. Sections in ``unread`` are never used by the caller:
    code there is not reported, and their redacted secrets are not asked for."""
    path = run_dir / "config.yaml"
    override_keys = [parse_override(override)[0] for override in overrides]
    imported = resolve_plugins(plugins, Path.cwd(), "--import")
    found = [
        entry
        for entry in folder_code(read_yaml(path), run_dir)
        if not _in_unread(entry, unread) and not _named_by(entry, override_keys, imported)
    ]
    if trust_code or not found:
        config = load_config(path, overrides, unread=unread, plugins=plugins)
        check(config)
        return config
    refused = [entry for entry in found if entry.defines_run]
    if refused:
        raise ConfigError(
            f"'{run_dir}' names code that evaluating or resuming it would run: "
            f"{', '.join(entry.describe() for entry in refused)}. A run folder is data and runs no code of its own: "
            "name the code yourself with an override of the same key (e.g. task.agent=path/to/agent.py:run, or "
            f"task.agent=null for the built-in agent loop), or pass {TRUST_FLAG} if you made the folder or trust "
            "who did"
        )
    notice = (
        f"'{run_dir}' names code that is not run, since a run folder must not run code of its own: "
        f"{', '.join(entry.describe() for entry in found)}. Pass {_how_to_take(found)} if you trust who made the "
        f"folder, or {TRUST_FLAG}"
    )
    try:
        config = load_config(
            path, overrides, unread=unread, plugins=plugins, edit=lambda tree: _without(tree, found, run_dir)
        )
        check(config)
    except ConfigError as error:
        raise ConfigError(f"{error}\n{notice}") from None
    notify(notice)
    return config


def _how_to_take(found: list[FolderCode]) -> str:
    ways = [f"--import {entry.shown}" for entry in found if entry.key == "plugins"]
    if any(entry.key == "model.trust_remote_code" for entry in found):
        ways.append("model.trust_remote_code=true")
    return " and ".join(ways)
