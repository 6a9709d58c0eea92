"""Load-time check of the options a configuration gives tasks, rewards and tools, against their registries.

``unipg.config`` cannot check these itself: the registries live here, in ``unipg.sample``, a layer above it.
So whoever loads a configuration to run it calls ``check_sample_options(config)`` right after ``load_config``:
the command line does (``unipg.cli.resolve``), and so will the public API, so that an unknown task, reward or
tool option stops the run before anything is built, with a message listing the accepted names.
"""

from __future__ import annotations

from typing import Any

import unipg.tasks.rewards  # registers every reward
import unipg.tasks  # registers every task
import unipg.tools  # noqa: F401  (registers every tool)
from unipg.config import Config, ConfigError
from unipg.config.loading import invalid_configuration
from unipg.registry import FactoryRegistry, RegistryError, unknown_name_message
from unipg.tasks.rewards.rules import REWARDS
from unipg.registry import check_option_types, validate_options
from unipg.tasks.base import TASKS
from unipg.tools.base import TOOL_SPEC_KEYS, TOOLS
from unipg.policy.tool_calls import TOOL_PARSERS



def check_sample_options(config: Config) -> None:
    """Raise ``ConfigError`` listing every unknown task, reward or tool name or option of ``config``, every
    missing required option and every option of the wrong plain type; each problem names where it is set."""
    if not config.is_lm:
        return
    task = config.task
    if task.name not in TASKS:
        problems = [f"task.name: {unknown_name_message(TASKS.kind, task.name, TASKS.names())}"]
    else:
        problems = option_problems(TASKS, task.name, task.options, "task.options")
        for index, stage in enumerate(config.sft.stages):
            merged = {**task.options, **stage.options}
            problems += option_problems(TASKS, task.name, merged, f"sft.stages[{index}].options")
    for index, spec in enumerate(task.rewards or []):
        options = {key: value for key, value in spec.items() if key not in ("name", "weight")}
        problems += spec_problems(REWARDS, spec, options, f"task.rewards[{index}]", "{name: math, weight: 1.0}")
    for index, spec in enumerate(task.tools or []):
        where = f"task.tools[{index}]"
        extra = [key for key in spec if key not in TOOL_SPEC_KEYS] if isinstance(spec, dict) else []
        if extra:
            problems.append(f"{where}: a tool takes only {', '.join(TOOL_SPEC_KEYS)}, not {', '.join(extra)}; put the "
                            f"tool's settings under options, e.g. {{name: python, options: {{timeout: 5}}}}")
        options = (spec.get("options") or {}) if isinstance(spec, dict) else {}
        if not isinstance(options, dict):
            problems.append(f"{where}.options must be a mapping of option names to values, got {options!r}")
            continue
        if isinstance(spec, dict) and "server" in spec:
            options = {**options, "server": spec["server"]}
        problems += spec_problems(TOOLS, spec, options, where, "{name: calculator}")
    if config.model.tool_parser is not None and config.model.tool_parser not in TOOL_PARSERS:
        problems.append("model.tool_parser: " + unknown_name_message(TOOL_PARSERS.kind, config.model.tool_parser,
                                                                     TOOL_PARSERS.names()))
    if problems:
        raise ConfigError(invalid_configuration(problems))


def spec_problems(registry: FactoryRegistry, spec: Any, options: dict, where: str, example: str) -> list[str]:
    """The problems of one ``{name: ..., ...}`` entry of a list of rewards or tools."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        return [f"{where} must be a mapping with a 'name', e.g. {example}; got {spec!r}"]
    return option_problems(registry, spec["name"], options, where)


def option_problems(registry: FactoryRegistry, name: str, options: dict, where: str) -> list[str]:
    """What is wrong with building entry ``name`` of ``registry`` with ``options``, each prefixed by ``where``."""
    if name not in registry:
        return [f"{where}: {unknown_name_message(registry.kind, name, registry.names())}"]
    try:
        validate_options(registry, name, options)
        check_option_types(registry.kind, name, registry.get(name), options)
    except (ValueError, RegistryError) as error:
        return [f"{where}: {error}"]
    return []
