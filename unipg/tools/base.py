"""Tools an agent can call: typed Python functions with a JSON schema taken from their signature.

A ``Tool`` wraps a function (sync or async). Its name, description and parameter schema come from the
function itself, through ``transformers.utils.get_json_schema``: the name from ``__name__``, the description
from the docstring, each parameter's JSON type from its annotation and its description from the docstring's
``Args:`` section::

    @tool
    def calculator(expression: str) -> str:
        \"\"\"Evaluate an arithmetic expression exactly.

        Args:
            expression: digits, + - * / // % ** and parentheses, e.g. "4738*29".
        \"\"\"

``tool.schema()`` is the OpenAI function-calling description, the same object chat templates accept in
``apply_chat_template(..., tools=[...])``. A tool may declare a ``latency`` model (``LatencyModel``) that
delays every call, for experiments with slow tools; the environment service applies it.

``TOOLS`` maps a name to a factory ``(**options) -> Tool``, so configs can build tools with options
(``{"name": "python", "options": {"timeout": 5}}``). The tool is offered to the policy under the name it is
registered and configured under, whatever its function is called (``build_entry``): a tool registered as
``unit_convert`` over ``tool(convert)`` is called ``unit_convert``. A factory that builds several tools returns a
list and names them itself (an MCP server's tools), declaring with ``names_its_tools`` which names an entry's
options tell.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import inspect
import json
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from unipg.policy.tool_calls import Hermes
from unipg.registry import FactoryRegistry

TOOLS = FactoryRegistry("tool")
F = TypeVar("F", bound=Callable)


class ToolError(Exception):
    """A call the tool understood and refused (bad expression, no result): shown to the agent as an error
    observation and not retried. Any other exception counts as the tool failing (retried, then the default
    observation and the failure penalty)."""


# The keys of a tool spec: its registered name, its factory's options, a simulated delay per call, and the
# process that serves the tools (an MCP server: ``{name: mcp, server: {command: ..., args: [...]}}``).
TOOL_SPEC_KEYS = ("name", "options", "latency", "server")

OPEN_TAG, CLOSE_TAG = Hermes.open_tag, Hermes.close_tag  # the format tasks write demonstrations in


def format_tool_call(name: str, arguments: dict) -> str:
    """The text of a well-formed call, as demonstrations write it (``hermes``; ``rewrite_calls`` turns it into
    another family's format)."""
    return Hermes().format_tool_call(name, arguments)


@dataclass(frozen=True)
class LatencyModel:
    """Extra wall-clock delay of every call, drawn per call: for experiments with slow and uneven tools.

    - ``fixed``: always ``seconds``;
    - ``lognormal``: median ``seconds``, log-space standard deviation ``sigma``;
    - ``pareto``: heavy-tailed, ``seconds`` times a Pareto(``alpha``) draw (≥ 1), so a few calls take many
      times the typical latency, as seed-style "milliseconds to seconds" tool fleets do.
    """

    kind: str = "fixed"
    seconds: float = 0.0
    sigma: float = 1.0
    alpha: float = 1.5

    def __post_init__(self):
        if self.kind not in ("fixed", "lognormal", "pareto"):
            raise ValueError(f"latency kind must be 'fixed', 'lognormal' or 'pareto', got '{self.kind}'")
        if self.seconds < 0 or self.sigma < 0 or self.alpha <= 0:
            raise ValueError("latency seconds and sigma must be >= 0 and alpha > 0")

    def draw(self, rng: random.Random) -> float:
        if self.kind == "fixed":
            return self.seconds
        if self.kind == "lognormal":
            return self.seconds * math.exp(rng.gauss(0.0, self.sigma))
        return self.seconds * rng.paretovariate(self.alpha)


@dataclass
class Tool:
    """A callable the agent can invoke by name with JSON arguments."""

    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    function: Callable[..., Any]  # sync or async; returns a string or something JSON-serializable
    latency: LatencyModel | None = None
    required: list[str] = field(default_factory=list)
    close: Callable[[], None] | None = None  # releases what the tool holds (an MCP server); idempotent

    def schema(self) -> dict:
        """The OpenAI-style function description used in system prompts and chat templates."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.function)

    def check_arguments(self, arguments: object) -> str | None:
        """What is wrong with ``arguments`` for this tool, or None when they fit the schema; never raises."""
        if not isinstance(arguments, dict):
            return f"arguments must be a JSON object, got {json_type_name(arguments)}"
        properties = self.parameters.get("properties", {})
        unknown = [str(name) for name in arguments if name not in properties]
        if unknown:
            return f"unknown argument(s) {', '.join(unknown)}; {self.name} takes {', '.join(properties) or 'none'}"
        missing = [name for name in self.required if name not in arguments]
        if missing:
            return f"missing argument(s) {', '.join(missing)}"
        for name, value in arguments.items():
            problem = _schema_problem(value, properties[name])
            if problem:
                return f"argument '{name}' {problem}"
        return None


_JSON_NAMES = (
    (bool, "boolean"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    ((list, tuple), "array"),
    (dict, "object"),
)  # bool before int: True is an int to Python, not to JSON


def json_type_name(value: object) -> str:
    """The JSON name of a value's type (string, integer, number, boolean, null, array, object)."""
    if value is None:
        return "null"
    return next((name for python, name in _JSON_NAMES if isinstance(value, python)), type(value).__name__)


def _schema_problem(value: object, spec: object) -> str | None:
    """What keeps ``value`` from matching one parameter's schema (its type, enum, item type), or None."""
    if not isinstance(spec, dict) or (value is None and spec.get("nullable")):
        return None
    expected = spec.get("type")
    if isinstance(expected, str) and not _json_type_matches(value, expected):
        return f"must be {expected}, got {json_type_name(value)}"
    options = spec.get("enum")
    if isinstance(options, list) and value not in options:
        shown = ", ".join(json.dumps(option, default=str) for option in options)
        return f"must be one of {shown}, got {json.dumps(value, default=str)[:40]}"
    items = spec.get("items")
    item_type = items.get("type") if isinstance(items, dict) else None
    if expected == "array" and isinstance(item_type, str):
        wrong = [item for item in value if not _json_type_matches(item, item_type)]
        if wrong:
            return f"must be an array of {item_type}, got an element that is {json_type_name(wrong[0])}"
    return None


def _json_type_matches(value: object, expected: str) -> bool:
    if expected == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    python = {"string": str, "boolean": bool, "array": list, "object": dict}.get(expected)
    return python is None or isinstance(value, python)


def tool(
    function: Callable | None = None, *, name: str | None = None, latency: LatencyModel | None = None
) -> Tool | Callable[[Callable], Tool]:
    """Make a ``Tool`` from a typed function; usable as ``@tool`` or ``@tool(name=..., latency=...)``."""

    def build(fn: Callable) -> Tool:
        described = function_schema(fn)["function"]
        parameters = described["parameters"]
        parameters.setdefault("required", [])
        return Tool(
            name or fn.__name__,
            described.get("description") or "",
            parameters,
            fn,
            latency,
            list(parameters["required"]),
        )

    return build(function) if function is not None else build


def build_entry(name: str, options: dict) -> list[Tool]:
    """The tools config entry ``name`` builds with ``options``, each under the name the policy calls it by: a factory
    that returns one tool offers it under ``name``, the name it is registered and configured under (whatever the
    tool's function is called); one that returns a list (``names_its_tools``) has named them itself."""
    built = TOOLS.get(name)(**options)
    if isinstance(built, list):
        return built
    if built.name == name:
        return [built]
    renamed = copy.copy(built)  # the factory's object may be shared; attributes set on it are kept
    renamed.name = name
    return [renamed]


def names_its_tools(offers: Callable[[dict], list[str] | None]) -> Callable[[F], F]:
    """Mark a tool factory that returns a list of tools named by itself rather than by its entry (the tools an MCP
    server lists). ``offers(options)`` gives the names an entry with these options will offer, or None where only
    building it tells; the config check compares them with the tool calls of the task's demonstrations."""

    def mark(factory: F) -> F:
        factory.offers = offers
        return factory

    return mark


def offered_names(name: str, options: dict) -> list[str] | None:
    """The names config entry ``name`` with ``options`` offers its tools under, known before it is built: ``name``
    itself, or for a factory that names its tools, what its ``offers`` reads from the options (None where only
    building it tells)."""
    offers = getattr(TOOLS.get(name), "offers", None)
    return [name] if offers is None else offers(options)


_UNDOCUMENTED = "UNIPG-UNDOCUMENTED-ARGUMENT"


def function_schema(fn: Callable) -> dict:
    """The OpenAI function description of ``fn``, by ``transformers.utils.get_json_schema``: the JSON type of each
    parameter from its annotation, descriptions from the Google-style docstring (``Args:``). Unlike
    ``get_json_schema``, an argument the docstring does not describe is accepted, and left without a description."""
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    try:
        try:
            return get_json_schema(fn)
        except DocstringParsingException:
            return _schema_with_undocumented_arguments(fn)
    except TypeHintParsingException as error:
        raise TypeError(
            f"tool parameters must be annotated with str, int, float, bool, list, dict, Optional or "
            f"Literal; {fn.__name__}: {error}"
        ) from None


def _schema_with_undocumented_arguments(fn: Callable) -> dict:
    """``get_json_schema`` of a copy of ``fn`` whose docstring describes every argument, undescribed ones by a
    placeholder that is then removed."""
    import functools

    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import parse_google_format_docstring

    description, documented, _ = parse_google_format_docstring(inspect.getdoc(fn) or "")
    arguments = [
        parameter.name
        for parameter in inspect.signature(fn).parameters.values()
        if parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
    ]

    @functools.wraps(fn)
    def documented_copy(*args, **kwargs):
        return fn(*args, **kwargs)

    documented_copy.__doc__ = f"{description or fn.__name__}\n\nArgs:\n" + "\n".join(
        f"    {argument}: {(documented or {}).get(argument, _UNDOCUMENTED)}" for argument in arguments
    )
    schema = get_json_schema(documented_copy)
    schema["function"]["description"] = description or ""
    for spec in schema["function"]["parameters"]["properties"].values():
        if spec.get("description") == _UNDOCUMENTED:
            del spec["description"]
    return schema


_ATTEMPT = contextvars.ContextVar("unipg_tool_attempt", default=1)


def current_attempt() -> int:
    """Which attempt of its call a running tool is (1, then 2, ... on retries); 1 outside the service."""
    return _ATTEMPT.get()


def set_attempt(attempt: int) -> None:
    """Set ``current_attempt`` for the current context (where a remote call runs the attempt)."""
    _ATTEMPT.set(attempt)


@contextlib.contextmanager
def attempt_number(attempt: int):
    """Within ``with``: ``current_attempt()`` reads ``attempt``; after it, the context reads what it read
    before (an episode's own context reads 1 again after a call)."""
    token = _ATTEMPT.set(attempt)
    try:
        yield
    finally:
        _ATTEMPT.reset(token)
