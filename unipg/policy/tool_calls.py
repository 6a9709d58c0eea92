"""How a policy writes tool calls, per model family: the ``TOOL_PARSERS`` registry.

- ``hermes`` (Qwen2.5, Qwen3, Hermes): a JSON object between tags, anywhere in the turn::

      <tool_call>{"name": "calculator", "arguments": {"expression": "4738*29"}}</tool_call>

- ``llama3_json`` (Llama 3.1, 3.2): the turn is the JSON object itself, optionally after ``<|python_tag|>``, with
  the arguments under ``parameters``; several calls are separated by ``;``::

      {"name": "calculator", "parameters": {"expression": "4738*29"}}

Each parser is an object with ``parse_tool_calls(text) -> list[ToolCall]`` (no call: ``[]``; a call that cannot be
read: ``MalformedToolCall`` saying what is wrong) and ``format_tool_call(name, arguments) -> str`` (the text of a
call, for demonstrations). ``stop`` lists the strings that complete a call, at which sampling stops so the tool
can run at once; ``markers`` are texts in a chat template that show its models use the format, so that
``parser_for_template`` picks it (``model.tool_parser`` overrides).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from unipg.registry import FactoryRegistry

TOOL_PARSERS = FactoryRegistry("tool parser")


@dataclass(frozen=True)
class ToolCall:
    """One call a turn asks for."""

    name: str
    arguments: object  # the JSON value given as arguments: an object for a well-formed call


class MalformedToolCall(ValueError):
    """A turn that starts a call the parser cannot read; the message says what is wrong, for the policy."""


def _read_json(decode) -> tuple[object, str | None]:
    """(what ``decode()`` returns, None), or (None, what is wrong with the text): any policy text is read
    without raising, whatever ``json`` raises on it (a decode error, nesting past the recursion limit, an
    integer longer than Python's int-string conversion limit)."""
    try:
        return decode(), None
    except json.JSONDecodeError as error:
        return None, f"the call is not valid JSON ({error.msg} at character {error.pos})"
    except RecursionError:  # nesting deeper than the interpreter's recursion limit
        return None, TOO_DEEP
    except ValueError as error:
        if "integer string conversion" in str(error):
            return None, "the call holds an integer with too many digits to read"
        return None, f"the call is not valid JSON ({str(error)[:80]})"


TOO_DEEP = "the call is nested too deeply to be read as JSON"
_DECODER = json.JSONDecoder()


def _named_call(value: object, arguments_key: str, shape: str) -> ToolCall:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise MalformedToolCall(f"the call must be {shape}")
    return ToolCall(value["name"], value.get(arguments_key, {}))


class Hermes:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, anywhere in the turn (Qwen, Hermes)."""

    open_tag, close_tag = "<tool_call>", "</tool_call>"
    stop = (close_tag,)
    markers = ("<tool_call>",)
    separator = ""  # between the calls of one turn

    def parse_tool_calls(self, text: str) -> list[ToolCall]:
        """Every call of the turn, in order. A call ends at the first ``</tool_call>``, or, when the text up to
        there is not valid JSON, at the end of the JSON object if ``</tool_call>`` follows it: so a string
        argument may itself contain the closing tag (code that prints it, say)."""
        calls, position = [], text.find(self.open_tag)
        while position >= 0:
            body_start = position + len(self.open_tag)
            close = text.find(self.close_tag, body_start)
            if close < 0:
                raise MalformedToolCall(f"the call has no closing {self.close_tag}")
            value, end, problem = self._call_json(text, body_start, close)
            if problem:
                raise MalformedToolCall(problem)
            calls.append(_named_call(value, "arguments", '{"name": "<tool>", "arguments": {...}}'))
            position = text.find(self.open_tag, end + len(self.close_tag))
        return calls

    def _call_json(self, text: str, body_start: int, first_close: int) -> tuple[object, int, str | None]:
        """(the JSON value of the call whose body starts at ``body_start``, where its closing tag starts, None),
        or (None, 0, what is wrong)."""
        value, problem = _read_json(lambda: json.loads(text[body_start:first_close].strip()))
        if problem is None or problem == TOO_DEEP:
            return value, first_close, problem
        body_start = len(text) - len(text[body_start:].lstrip())  # the first character after the spaces
        decoded, _ = _read_json(lambda: _DECODER.raw_decode(text, body_start))
        if decoded is not None and text[decoded[1] :].lstrip().startswith(self.close_tag):
            return decoded[0], text.index(self.close_tag, decoded[1]), None
        return None, 0, problem

    def format_tool_call(self, name: str, arguments: dict) -> str:
        return f"{self.open_tag}{json.dumps({'name': name, 'arguments': arguments})}{self.close_tag}"


class Llama3Json:
    """``{"name": ..., "parameters": {...}}`` as the whole turn, optionally after ``<|python_tag|>`` (Llama 3.x);
    several calls separated by ``;``. A turn that does not start with a JSON object is an answer."""

    python_tag = "<|python_tag|>"
    stop = ()  # a call is the whole turn: it ends with the turn's end-of-turn token
    markers = ("<|start_header_id|>", '"parameters"')
    separator = "; "

    def parse_tool_calls(self, text: str) -> list[ToolCall]:
        body = text.strip()
        tagged = body.startswith(self.python_tag)
        body = body[len(self.python_tag) :].lstrip() if tagged else body
        if not body.startswith("{"):
            if tagged:
                raise MalformedToolCall('after <|python_tag|> the call must be {"name": ..., "parameters": {...}}')
            return []
        calls, position = [], 0
        while position < len(body):
            decoded, problem = _read_json(lambda: _DECODER.raw_decode(body, position))
            if problem:
                if not calls and not tagged and not body.startswith('{"name"'):
                    return []  # an answer that happens to start with a brace
                raise MalformedToolCall(problem)
            value, position = decoded
            calls.append(
                _named_call(
                    value,
                    "parameters" if "parameters" in value else "arguments",
                    '{"name": "<tool>", "parameters": {...}}',
                )
                if isinstance(value, dict)
                else _named_call(value, "parameters", "a JSON object")
            )
            position = len(body) - len(body[position:].lstrip().lstrip(";").lstrip())
        return calls

    def format_tool_call(self, name: str, arguments: dict) -> str:
        return json.dumps({"name": name, "parameters": arguments})


TOOL_PARSERS.register("hermes")(Hermes)
TOOL_PARSERS.register("llama3_json")(Llama3Json)


def tool_parser(name: str = "hermes"):
    """The parser registered as ``name`` (an unknown name: an error listing the known ones)."""
    return TOOL_PARSERS.get(name)()


def parse_tool_calls(text: str, parser: str = "hermes") -> list[ToolCall]:
    """The calls ``text`` asks for in format ``parser``; raises ``MalformedToolCall`` for a call it cannot read."""
    return tool_parser(parser).parse_tool_calls(text)


def rewrite_calls(text: str, parser: str) -> str:
    """A turn written with ``hermes`` calls (as tasks write demonstrations), in format ``parser``: a turn with calls
    becomes its calls alone in that format; a turn without is unchanged."""
    if parser == "hermes":
        return text
    calls = Hermes().parse_tool_calls(text)
    if not calls:
        return text
    target = tool_parser(parser)
    return target.separator.join(target.format_tool_call(call.name, call.arguments) for call in calls)


def parser_for_template(chat_template: object) -> str:
    """The tool-call format a chat template's models write: the first whose markers the template holds, else
    ``hermes``."""
    text = chat_template if isinstance(chat_template, str) else ""
    for name in TOOL_PARSERS.names():
        if name != "hermes" and all(marker in text for marker in TOOL_PARSERS.get(name).markers):
            return name
    return "hermes"
