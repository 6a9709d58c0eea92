"""OpenAI chat messages → the text the policy continues, and sampled text → OpenAI tool calls.

Tool calls cross one small boundary, ``ToolCallFormat``: how a model family writes a call in its text
(``parse``), how a call of an earlier turn is written back into a prompt (``format``), and the string that
closes a call (sampling stops there, as the native agent loop does: one call per turn). ``tool_call_format``
picks the registered format of a tokenizer's chat template (Hermes ``<tool_call>{json}</tool_call>`` unless the
template is of another family, e.g. Llama 3's JSON calls).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from unipg.policy.chat import render_tools
from unipg.policy.tool_calls import MalformedToolCall, parser_for_template, tool_parser


class RequestError(ValueError):
    """A request the endpoint cannot serve: an HTTP ``status`` (400 unless told) with an OpenAI error object whose
    ``param`` names the offending field and ``code`` is OpenAI's code for the error, if it has one."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it

    def key(self) -> tuple[str, str]:
        """The call compared by meaning: the arguments' JSON re-serialised with sorted keys."""
        try:
            return self.name, json.dumps(json.loads(self.arguments), sort_keys=True)
        except ValueError:
            return self.name, self.arguments


class ToolCallFormat:
    """A registered tool-call parser (``unipg.policy.tool_calls``) as the endpoint uses it: OpenAI calls
    (arguments as JSON text) in and out of the model's text."""

    def __init__(self, parser: str = "hermes"):
        self.name, self.parser = parser, tool_parser(parser)
        self.close = self.parser.stop[0] if self.parser.stop else None  # sampling stops after a call

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(the text before the first call, the calls); a call the parser cannot read leaves the text as it is
        and no calls, so the agent sees what the model wrote."""
        try:
            calls = self.parser.parse_tool_calls(text)
        except MalformedToolCall:
            return text, []
        if not calls or not all(isinstance(call.arguments, dict) for call in calls):
            return text, []
        start = text.find(self.parser.open_tag) if hasattr(self.parser, "open_tag") else 0
        return text[:start].strip(), [ToolCall(call.name, json.dumps(call.arguments)) for call in calls]

    def format(self, calls: list[ToolCall]) -> str:
        return self.parser.separator.join(
            self.parser.format_tool_call(call.name, json.loads(call.arguments)) for call in calls
        )


def tool_call_format(tokenizer) -> ToolCallFormat:
    """The tool-call format of ``tokenizer``'s model family (from its chat template)."""
    return ToolCallFormat(parser_for_template(getattr(tokenizer, "chat_template", None)))


def content_text(content, where: str) -> str:
    """A message's content as text: a string, None, or a list of ``{"type": "text", "text": ...}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise RequestError(f"{where}: only text content parts are supported", where)
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"{where}: content must be text or a list of text parts", where)


MAX_ARGUMENTS_DEPTH = 64  # nesting of a call's arguments sent back; deeper JSON would exhaust the stack


def message_calls(message: dict, where: str) -> list[ToolCall]:
    """The tool calls an assistant message carries (OpenAI ``tool_calls``), each with a JSON object as arguments."""
    listed = message.get("tool_calls") or []
    if not isinstance(listed, list):
        raise RequestError(f"{where}.tool_calls must be a list of calls", f"{where}.tool_calls")
    calls = []
    for index, call in enumerate(listed):
        at = f"{where}.tool_calls[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise RequestError(f"{at} needs function.name and function.arguments", at)
        calls.append(ToolCall(function["name"], call_arguments(function.get("arguments"), at)))
    return calls


def call_arguments(arguments, where: str) -> str:
    """A call's arguments as JSON text of an object: the text as sent, or the JSON of an object sent as one.
    Text that is no JSON, holds an integer past Python's int-string limit, nests deeper than
    ``MAX_ARGUMENTS_DEPTH`` or is no object is a ``RequestError`` naming the call."""
    if arguments is None or arguments == "":
        return "{}"
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        text = arguments if isinstance(arguments, str) else json.dumps(parsed)
    except (ValueError, TypeError, RecursionError) as error:
        reason = "it nests too deeply" if isinstance(error, RecursionError) else str(error)[:200]
        raise RequestError(f"{where}: function.arguments must be the JSON text of an object ({reason})", where)
    if not isinstance(parsed, dict):
        raise RequestError(f"{where}: function.arguments must be a JSON object, not {type(parsed).__name__}", where)
    if _depth(parsed) > MAX_ARGUMENTS_DEPTH:
        raise RequestError(f"{where}: function.arguments nests deeper than {MAX_ARGUMENTS_DEPTH} levels", where)
    return text


def _depth(value) -> int:
    """How deeply lists and objects nest in ``value`` (without recursion: the depth is what is being bounded)."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, level = pending.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            pending += [(child, level + 1) for child in (item.values() if isinstance(item, dict) else item)]
    return deepest


def reply_key(content: str, calls: list[ToolCall]) -> tuple:
    """How an assistant message the endpoint returned is recognised when an agent sends it back."""
    return content.strip(), tuple(call.key() for call in calls)


def plain_messages(messages: list, raw_replies: dict[tuple, str], calls_format: ToolCallFormat) -> list[dict]:
    """``{"role", "content"}`` messages the chat template renders. An assistant message that is a reply of this
    session is replaced by the exact text the model sampled (``raw_replies``), so the rendered conversation
    continues the sampled tokens; other assistant calls are written in the model's call format. A tool message
    answers a call of an earlier assistant message: its ``tool_call_id`` must be one of theirs, as OpenAI checks."""
    plain, call_ids = [], set()
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in (
            "system",
            "developer",
            "user",
            "assistant",
            "tool",
        ):
            raise RequestError(f"{where}: role must be system, developer, user, assistant or tool", where)
        role, content = message["role"], content_text(message.get("content"), where)
        if role == "assistant":
            calls = message_calls(message, where)
            raw = raw_replies.get(reply_key(content, calls))
            content = raw if raw is not None else content + calls_format.format(calls)
            call_ids.update(call["id"] for call in message.get("tool_calls") or [] if isinstance(call.get("id"), str))
        if role == "tool":
            check_answered_call(message.get("tool_call_id"), call_ids, where)
        plain.append({"role": "system" if role == "developer" else role, "content": content})
    return plain


def check_answered_call(tool_call_id, call_ids: set, where: str) -> None:
    """A tool message's ``tool_call_id``: the id of a call an earlier assistant message made."""
    if not isinstance(tool_call_id, str) or not tool_call_id:
        raise RequestError(
            f"{where}.tool_call_id is required: the id of the tool call this message answers",
            f"{where}.tool_call_id",
        )
    if tool_call_id not in call_ids:
        raise RequestError(
            f"{where}.tool_call_id {tool_call_id[:100]!r} matches no tool call of an earlier assistant message; a "
            "message with role 'tool' must answer a call in a preceding message's 'tool_calls'",
            f"{where}.tool_call_id",
        )


def render_conversation(tokenizer, messages: list[dict], tools: list[dict] | None) -> str:
    """The prompt text of ``messages``, ending with the opening of the assistant's turn; ``tools`` are described
    through the template's ``tools`` argument when it has one, else in the system message."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if tools and not (isinstance(template, str) and "tools" in template):
        description = render_tools(tools)
        if messages and messages[0]["role"] == "system":
            messages = [{"role": "system", "content": f"{messages[0]['content']}\n{description}"}, *messages[1:]]
        else:
            messages = [{"role": "system", "content": description}, *messages]
        tools = None
    if template:
        options = {"tools": tools} if tools else {}
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **options)
        except Exception as error:  # noqa: BLE001 — templates refuse conversations they cannot write (raise_exception)
            raise RequestError(
                f"messages: the model's chat template cannot render this conversation: {str(error)[:300]}", "messages"
            ) from None
    return "\n".join(message["content"] for message in messages)


def check_tools(tools) -> list[dict] | None:
    """The request's ``tools`` as OpenAI function descriptions (the form chat templates accept)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of {type: function, function: {...}}", "tools")
    for index, spec in enumerate(tools):
        where = f"tools[{index}]"
        function = spec.get("function") if isinstance(spec, dict) else None
        if spec_problem := _function_problem(spec, function):
            raise RequestError(
                f"{where}: {spec_problem}; a tool is {{type: function, function: {{name, description, parameters}}}}",
                where,
            )
        function.setdefault("description", "")
        function.setdefault("parameters", {"type": "object", "properties": {}})
    return tools


def _function_problem(spec, function) -> str | None:
    """What is wrong with one entry of ``tools`` (None: nothing), checking what the prompt renders of it."""
    if not isinstance(spec, dict) or spec.get("type") != "function" or not isinstance(function, dict):
        return "not a function tool"
    if not isinstance(function.get("name"), str) or not function["name"]:
        return "function.name must be a non-empty string"
    if not isinstance(function.get("description", ""), str):
        return "function.description must be a string"
    parameters = function.get("parameters", {})
    properties = parameters.get("properties", {}) if isinstance(parameters, dict) else None
    if not isinstance(properties, dict) or not all(isinstance(schema, dict) for schema in properties.values()):
        return "function.parameters must be a JSON schema object whose properties are schemas"
    return None


def openai_tool_calls(calls: list[ToolCall]) -> list[dict]:
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for call in calls
    ]
