"""Load-time check of the names and options a configuration gives tasks, rewards, tools, the environment and the
inference engine, against their registries.

``unipg.config`` cannot check these itself: the registries live in the layers above it (``unipg.tasks``,
``unipg.tools``, ``unipg.envs``, ``unipg.inference``), all visible from here. So whoever loads a configuration
to run it calls ``check_sample_options(config)`` right after ``load_config`` (``unipg.load_config`` does, and
with it the command line), so that an unknown name or option stops the run before anything is built, with a
message listing the accepted ones.
"""

from __future__ import annotations

from typing import Any

import unipg.tasks  # registers every task
import unipg.tasks.rewards  # registers every reward
import unipg.tools  # noqa: F401  (registers every tool)
from unipg.config import Config, ConfigError
from unipg.config.loading import invalid_configuration
from unipg.config.specs import reward_spec
from unipg.policy.tool_calls import TOOL_PARSERS, Hermes, MalformedToolCall
from unipg.registry import FactoryRegistry, RegistryError, check_option_types, unknown_name_message, validate_options
from unipg.tasks.base import TASKS, make_task
from unipg.tasks.rewards.rules import REWARDS
from unipg.tools.base import TOOL_SPEC_KEYS, TOOLS, offered_names


def check_sample_options(config: Config) -> None:
    """Raise ``ConfigError`` listing every unknown task, reward, tool, environment or engine name or option of
    ``config``, every missing required option and every option of the wrong plain type; each problem names where
    it is set."""
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
    for index, entry in enumerate(task.rewards or []):
        problems += reward_problems(entry, f"task.rewards[{index}]")
    for index, spec in enumerate(task.tools or []):
        where = f"task.tools[{index}]"
        extra = [key for key in spec if key not in TOOL_SPEC_KEYS] if isinstance(spec, dict) else []
        if extra:
            problems.append(
                f"{where}: a tool takes only {', '.join(TOOL_SPEC_KEYS)}, not {', '.join(extra)}; put the "
                f"tool's settings under options, e.g. {{name: python, options: {{timeout: 5}}}}"
            )
        options = (spec.get("options") or {}) if isinstance(spec, dict) else {}
        if not isinstance(options, dict):
            problems.append(f"{where}.options must be a mapping of option names to values, got {options!r}")
            continue
        if isinstance(spec, dict) and "server" in spec:
            options = {**options, "server": spec["server"]}
        problems += spec_problems(TOOLS, spec, options, where, "{name: calculator}")
    if config.model.tool_parser is not None and config.model.tool_parser not in TOOL_PARSERS:
        problems.append(
            "model.tool_parser: "
            + unknown_name_message(TOOL_PARSERS.kind, config.model.tool_parser, TOOL_PARSERS.names())
        )
    problems += environment_problems(config) + engine_problems(config)
    if not problems:  # the task and tool entries are valid: their names can be compared
        problems += demonstrated_tool_problems(config)
    if problems:
        raise ConfigError(invalid_configuration(problems))


def environment_problems(config: Config) -> list[str]:
    """What is wrong with ``task.env`` and ``task.env_options``: an unknown environment, or options it does not
    accept (or options without an environment to give them to)."""
    from unipg.envs import ENVS  # registers every environment; imported here, so ``import unipg`` stays light

    task = config.task
    if task.env is None:
        if task.env_options:
            return [
                (
                    f"task.env_options are set but task.env is not; name the environment they are for, e.g. "
                    f"task.env=tool (environments: {', '.join(ENVS.names())})"
                )
            ]
        return []
    if task.env not in ENVS:
        return [f"task.env: {unknown_name_message(ENVS.kind, task.env, ENVS.names())}"]
    return option_problems(ENVS, task.env, task.env_options, "task.env_options")


def engine_problems(config: Config) -> list[str]:
    """An unknown ``sample.engine``, with the registered ones."""
    from unipg.inference import ENGINES  # registers every engine; imported here, as ENVS above

    if config.sample.engine in ENGINES:
        return []
    return ["sample.engine: " + unknown_name_message(ENGINES.kind, config.sample.engine, ENGINES.names())]


def reward_problems(entry: Any, where: str) -> list[str]:
    """The problems of one entry of ``task.rewards``: ``{name, weight, options}``, or with its options beside the
    name (``unipg.config.specs``)."""
    try:
        spec, _ = reward_spec(entry, where)
    except ValueError as error:
        return [str(error)]
    options = spec.get("options", {}) if isinstance(spec, dict) else {}
    if not isinstance(options, dict):
        return [
            f"{where}.options must be a mapping of option names to values, e.g. {{max_length: 200}}; got {options!r}"
        ]
    return spec_problems(REWARDS, spec, options, where, "{name: math, weight: 1.0}")


def demonstrated_tool_problems(config: Config) -> list[str]:
    """Tool calls in the task's demonstrations that ``task.tools`` does not offer. An entry offers its tool under its
    own name, so only an entry that names its tools itself (``names_its_tools``: an MCP server's, ``faulty``) can
    miss; the task is built to read its demonstrations only when there is one."""
    entries = [(spec["name"], tool_options(spec)) for spec in config.task.tools or []]
    if all(getattr(TOOLS.get(name), "offers", None) is None for name, _ in entries):
        return []
    offered, unknown = set(), []
    for index, (name, options) in enumerate(entries):
        names = offered_names(name, options)
        if names is None:
            unknown.append(f"task.tools[{index}] ({name})")
        else:
            offered.update(names)
    try:
        task = make_task(config.task.name, **config.task.options)
    except Exception:  # noqa: BLE001  (the run builds the task too, and says what is wrong with it)
        return []
    missing = sorted(demonstrated_tool_names(task) - offered)
    if not missing:
        return []
    calls = f"the demonstrations of task '{task.name}' call {', '.join(missing)}, which task.tools "
    if unknown:
        return [
            calls + f"does not name: {', '.join(unknown)} offers what its server lists; name the tools in its "
            f"include option (e.g. include: [{', '.join(missing)}]), or offer them under these names"
        ]
    return [
        calls + f"does not offer (it offers {', '.join(sorted(offered)) or 'none'}); a policy trained on the "
        "demonstrations would call a tool that is not there: offer them under these names"
    ]


def demonstrated_tool_names(task) -> set[str]:
    """The names of the tools the task's demonstrations call (in the hermes format tasks write them in)."""
    examples = [*task.train, *(task.validation or []), *task.test]
    solutions = [example.solution for example in examples]
    if task.role_demonstrations is not None:
        solutions += [solution for example in examples for _, _, solution in task.role_demonstrations(example)]
    parser, names = Hermes(), set()
    for solution in solutions:
        for message in solution if isinstance(solution, list) else []:
            if message.get("role") == "assistant" and parser.open_tag in message.get("content", ""):
                try:
                    names.update(call.name for call in parser.parse_tool_calls(message["content"]))
                except MalformedToolCall:  # a demonstration of a malformed call calls no tool
                    continue
    return names


def tool_options(spec: dict) -> dict:
    """The options of a ``task.tools`` entry, its ``server`` included (as ``build_tools`` hands them)."""
    return {**(spec.get("options") or {}), **({"server": spec["server"]} if "server" in spec else {})}


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
