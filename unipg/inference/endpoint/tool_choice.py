"""``tool_choice`` of a chat request: whether the reply must be a tool call, and the opening of that call.

OpenAI honours ``"required"`` and ``{"type": "function", "function": {"name": N}}`` by constraining the model's
decoding. The endpoint does not touch the policy's distribution; it writes the start of the call into the reply
itself and lets the policy sample the rest:

- ``"required"``: the call format's text up to the function's name (Hermes ``<tool_call>{"name": "``), so the
  policy picks the name (among the tools, if it writes one of them) and the arguments;
- a named function: the text up to the arguments (``<tool_call>{"name": "N", "arguments": ``), so the policy
  writes the arguments of ``N``.

The opening is text of the environment, like a tool result: its tokens enter the session's trajectory with loss
mask 0 and no behaviour log-prob, and every token after it is sampled from the policy's own distribution given
everything before it. The learner's objective sums over sampled tokens only, each weighted by the ratio of the
policy to the behaviour probability of that token in that context, so inserting text is unbiased for what the
policy sampled. Constrained decoding would not be: masking the vocabulary changes the distribution the tokens
were drawn from, and the recorded log-probs would then not be the policy's.

The opening is derived from the format's own writer (``format_tool_call``: the text unipg writes for a call, in
demonstrations and in histories sent back), so every registered format that writes the name and then the
arguments as JSON gets one; a format that writes them otherwise is refused with an error naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from unipg.inference.endpoint.render import RequestError, ToolCallFormat

NAME_MARK = "unipgToolNameMark"  # stands for the name in a call written to find where the name starts
ARGUMENTS_MARK = "unipgArgumentsMark"  # the one key of the arguments written to find where they start


@dataclass(frozen=True)
class ForcedCall:
    """A reply that must be a tool call."""

    opening: str  # inserted at the start of the reply, before the policy samples
    name: str | None  # the function tool_choice names; None: any ("required")


def forced_call(tool_choice, tools: list[dict] | None, calls_format: ToolCallFormat) -> ForcedCall | None:
    """The call ``tool_choice`` forces (None: the policy decides, ``auto``/``none``/absent); a ``tool_choice`` that
    is not one of OpenAI's forms, comes without ``tools`` or names a function that is not among them is a
    ``RequestError`` naming ``tool_choice``."""
    if tool_choice is None:
        return None
    if not tools:
        raise RequestError(
            "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified", "tool_choice"
        )
    if tool_choice in ("auto", "none"):
        return None
    if tool_choice == "required":
        return ForcedCall(call_opening(calls_format, None), None)
    name = chosen_name(tool_choice)
    offered = [tool["function"]["name"] for tool in tools]
    if name not in offered:
        raise RequestError(
            f"Invalid value for 'tool_choice': function {name!r} is not among the request's tools "
            f"({', '.join(offered)})",
            "tool_choice",
        )
    return ForcedCall(call_opening(calls_format, name), name)


def chosen_name(tool_choice) -> str:
    """The function name of ``{"type": "function", "function": {"name": N}}``; any other value is a
    ``RequestError`` listing the forms."""
    kind, function = (
        (tool_choice.get("type"), tool_choice.get("function")) if isinstance(tool_choice, dict) else (None, None)
    )
    name = function.get("name") if isinstance(function, dict) else None
    if kind != "function" or not isinstance(name, str) or not name:
        raise RequestError(
            'tool_choice must be \'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    return name


def call_opening(calls_format: ToolCallFormat, name: str | None) -> str:
    """The text of a call in ``calls_format`` up to the function's name (``name`` None), or up to the arguments
    of function ``name``: a call written by the format itself with marks in place of the name and the
    arguments, cut where the mark starts."""
    marked = calls_format.parser.format_tool_call(NAME_MARK, {ARGUMENTS_MARK: 0})
    up_to_name = marked.find(NAME_MARK)
    up_to_arguments = marked.find("{" + json.dumps(ARGUMENTS_MARK))
    if not 0 < up_to_name < up_to_arguments or marked.count(NAME_MARK) != 1:
        raise RequestError(
            f"tool_choice 'required' or a named function cannot be honoured with the '{calls_format.name}' tool-call "
            "format (it does not write the function's name before its JSON arguments); use tool_choice 'auto'",
            "tool_choice",
        )
    if name is None:
        return marked[:up_to_name]
    named = calls_format.parser.format_tool_call(name, {ARGUMENTS_MARK: 0})
    return named[: named.rindex("{" + json.dumps(ARGUMENTS_MARK))]
