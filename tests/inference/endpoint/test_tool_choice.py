"""``tool_choice: required`` and a named function: the call's opening inserted as environment tokens (loss mask 0),
the rest sampled by the policy, the reply parsed from both."""

import httpx
import openai
import pytest
from openai import OpenAI

from unipg.inference import TurnOutput
from unipg.inference.endpoint.render import RequestError, ToolCallFormat
from unipg.inference.endpoint.tool_choice import call_opening
from unipg.policy.tool_calls import TOOL_PARSERS

MESSAGES = [{"role": "user", "content": "What is 2*3?"}]


def function(name):
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": "Evaluate an expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }


TOOLS = [function("calculator")]
NAMED = {"type": "function", "function": {"name": "calculator"}}


def session_client(served):
    session = served.loop.sessions.open()
    return session, OpenAI(base_url=served.loop.server.session_url(session.id), api_key=session.key, max_retries=0)


def ids(served, text):
    return served.loop.tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture
def scripted(served, monkeypatch):
    """``scripted(text)``: the engine answers every request by "sampling" ``text`` (log-prob -0.25 per token)."""
    engine = served.loop.completions.engine

    def script(text):
        async def generate(context_ids, *, max_new_tokens, order=0, params=None):
            tokens = ids(served, text)
            output = TurnOutput(tokens, [-0.25] * len(tokens), text, "stop", False, 0)
            engine.sampled.append((list(context_ids), output))
            return output

        monkeypatch.setattr(engine, "generate", generate)

    return script


@pytest.mark.parametrize("parser", TOOL_PARSERS.names())
def test_every_registered_format_has_openings_that_its_parser_reads_back(parser):
    calls_format = ToolCallFormat(parser)
    anyone, named = call_opening(calls_format, None), call_opening(calls_format, "calculator")
    assert anyone and named.startswith(anyone + "calculator")
    written = calls_format.parser.format_tool_call("calculator", {"expression": "2*3"})
    assert written.startswith(named)
    content, [call] = calls_format.parse(written)
    assert (content, call.name) == ("", "calculator")


def test_a_format_that_writes_no_json_name_is_refused_naming_it():
    class Pythonic:
        def format_tool_call(self, name, arguments):
            return f"[{name}({', '.join(f'{key}={value!r}' for key, value in arguments.items())})]"

    calls_format = ToolCallFormat()
    calls_format.name, calls_format.parser = "pythonic", Pythonic()
    with pytest.raises(RequestError, match="'pythonic' tool-call format") as refused:
        call_opening(calls_format, "calculator")
    assert refused.value.param == "tool_choice"


def test_a_named_tool_choice_inserts_the_opening_with_loss_mask_0_and_returns_the_call(served, scripted):
    session, client = session_client(served)
    scripted('{"expression": "2*3"}}</tool_call>')
    reply = client.chat.completions.create(model="unipg", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"  # as OpenAI answers a call forced by name
    [call] = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("calculator", '{"expression": "2*3"}')
    opening = ids(served, '<tool_call>{"name": "calculator", "arguments": ')
    sampled = ids(served, '{"expression": "2*3"}}</tool_call>')
    [trajectory] = session.trajectories
    context, _ = served.loop.completions.engine.sampled[-1]
    assert context == trajectory.prompt_ids + opening  # the policy continues after the opening
    assert trajectory.token_ids == opening + sampled
    assert trajectory.loss_mask == [0] * len(opening) + [1] * len(sampled)
    assert trajectory.behaviour_logprobs == [0.0] * len(opening) + [-0.25] * len(sampled)

    history = [*MESSAGES, choice.message.model_dump(exclude_none=True)]
    history.append({"role": "tool", "tool_call_id": call.id, "content": "6"})
    client.chat.completions.create(model="unipg", messages=history, tools=TOOLS, tool_choice=NAMED)
    assert session.trajectories == [trajectory] and trajectory.turns == 2  # the reply sent back continues it
    second, _ = served.loop.completions.engine.sampled[-1]
    assert trajectory.ids == second + sampled and second[-len(opening) :] == opening
    added = len(second) - len(trajectory.prompt_ids) - len(opening) - len(sampled)
    assert trajectory.loss_mask == [0] * len(opening) + [1] * len(sampled) + [0] * added + [1] * len(sampled)


def test_required_with_the_openai_client_lets_the_policy_pick_the_name(served, scripted):
    session, client = session_client(served)
    scripted('square", "arguments": {"expression": "3"}}</tool_call>')
    tools = [function("calculator"), function("square")]
    reply = client.chat.completions.create(model="unipg", messages=MESSAGES, tools=tools, tool_choice="required", n=2)
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        assert [call.function.name for call in choice.message.tool_calls] == ["square"]
    opening = ids(served, '<tool_call>{"name": "')
    assert len(session.trajectories) == 2
    for trajectory in session.trajectories:  # each choice's trajectory holds the opening, loss mask 0
        assert trajectory.token_ids[: len(opening)] == opening
        assert trajectory.loss_mask == [0] * len(opening) + [1] * (len(trajectory.token_ids) - len(opening))


def test_a_continuation_that_is_no_call_is_returned_as_text(served, scripted):
    session, client = session_client(served)
    scripted("six, I think")
    reply = client.chat.completions.create(model="unipg", messages=MESSAGES, tools=TOOLS, tool_choice="required")
    choice = reply.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content == '<tool_call>{"name": "six, I think'


def test_the_real_policy_samples_after_the_opening_whatever_it_writes(served):
    session, client = session_client(served)
    reply = client.chat.completions.create(
        model="unipg", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=8, temperature=0.7
    )
    opening = ids(served, '<tool_call>{"name": "calculator", "arguments": ')
    [trajectory] = session.trajectories
    sampled = len(trajectory.token_ids) - len(opening)
    assert 0 < sampled <= 8 and reply.usage.completion_tokens == sampled
    assert trajectory.loss_mask == [0] * len(opening) + [1] * sampled
    choice = reply.choices[0]
    assert choice.message.tool_calls or choice.message.content.startswith('<tool_call>{"name": "calculator"')


@pytest.mark.parametrize(
    "tools, tool_choice, phrase",
    [
        (None, "required", "only allowed when 'tools' are specified"),
        (None, "auto", "only allowed when 'tools' are specified"),
        (TOOLS, {"type": "function", "function": {"name": "search"}}, "'search' is not among the request's tools"),
        (TOOLS, {"type": "custom", "custom": {"name": "calculator"}}, "tool_choice must be"),
        (TOOLS, {"type": "function", "function": {}}, "tool_choice must be"),
        (TOOLS, "always", "tool_choice"),
    ],
)
def test_a_tool_choice_the_endpoint_cannot_honour_is_a_400_naming_it(served, tools, tool_choice, phrase):
    session = served.loop.sessions.open()
    body = {"messages": MESSAGES, "max_tokens": 2, "tool_choice": tool_choice}
    if tools is not None:
        body["tools"] = tools
    refused = httpx.post(
        f"{served.loop.server.session_url(session.id)}/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {session.key}"},
        timeout=60,
    )
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "tool_choice" and phrase in error["message"], error
    assert session.calls == 0


def test_the_openai_client_sees_a_bad_request(served):
    _, client = session_client(served)
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="unipg", messages=MESSAGES, tool_choice="required")
