"""Hostile requests: each fails alone, as a 4xx OpenAI error object naming what to fix, and the connection it came
on and every other session's requests go on working."""

import asyncio
import logging

import httpx
import pytest

from unipg.config import ConfigError, load_config
from unipg.inference.endpoint import EndpointServer
from unipg.inference.endpoint.server import exposure
from unipg.inference.endpoint.sessions import tokenize
from unipg.policy.embedded import build_tokenizer

MESSAGES = [{"role": "user", "content": "What is 2*3?"}]


def chat_url(served, session):
    return f"{served.loop.server.session_url(session.id)}/chat/completions"


def headers(session):
    return {"authorization": f"Bearer {session.key}"}


def assert_refused(response, param, *phrases, status=400):
    """An OpenAI error object naming ``param``, its message holding ``phrases``."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    for phrase in phrases:
        assert phrase in error["message"], error["message"]


def test_a_degenerate_temperature_is_refused_and_fails_no_request_of_another_session(served_roomy):
    sessions = [served_roomy.loop.sessions.open(order) for order in range(9)]

    async def at_once():
        async with httpx.AsyncClient(timeout=60) as client:
            bodies = [{"messages": MESSAGES, "max_tokens": 3, "temperature": 0.7} for _ in range(8)]
            bodies.append({"messages": MESSAGES, "max_tokens": 3, "temperature": 1e-300})
            return await asyncio.gather(
                *(
                    client.post(chat_url(served_roomy, session), json=body, headers=headers(session))
                    for session, body in zip(sessions, bodies)
                )
            )

    *others, hostile = served_roomy.call(at_once())
    assert [response.status_code for response in others] == [200] * 8
    assert all(session.calls == 1 for session in sessions[:8])
    assert_refused(hostile, "temperature", "1e-300", "smallest positive temperature is 0.01", "0 for greedy")
    assert sessions[8].calls == 0


@pytest.mark.parametrize(
    "arguments, phrase",
    [
        ("{not json", "JSON text of an object"),
        ('{"x": ' + "9" * 4301 + "}", "JSON text of an object"),  # past Python's int-string limit: a ValueError
        ("[" * 10_000 + "]" * 10_000, "JSON text of an object"),  # deeper than json.loads recurses
        ("[1, 2]", "must be a JSON object, not list"),
        ('{"a": ' * 65 + "1" + "}" * 65, "nests deeper than 64 levels"),
    ],
)
def test_a_tool_call_sent_back_with_bad_arguments_is_a_400_naming_the_call_and_the_connection_lives_on(
    served_roomy, arguments, phrase
):
    session = served_roomy.loop.sessions.open()
    call = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": arguments}}
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]}]
    with httpx.Client(timeout=60, headers=headers(session)) as client:
        refused = client.post(chat_url(served_roomy, session), json={"messages": history, "max_tokens": 2})
        assert_refused(refused, "messages[1].tool_calls[0]", phrase)
        answered = client.post(chat_url(served_roomy, session), json={"messages": MESSAGES, "max_tokens": 2})
        assert answered.status_code == 200 and session.calls == 1  # on the same connection


@pytest.mark.parametrize(
    "field, value, param, phrase",
    [
        ("stop", [""], "stop", "stop strings must not be empty"),
        ("stop", "", "stop", "stop strings must not be empty"),
        ("stop", ["x"] * 17, "stop", "at most 16 stop strings"),
        ("messages", [{"role": "assistant", "content": "", "tool_calls": 5}], "messages[0].tool_calls", "a list"),
        ("tools", [5], "tools[0]", "should be an object"),
        ("tools", [{"type": "retrieval"}], "tools[0]", "not a function tool"),
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": []}}], "tools[0]", "JSON schema"),
        ("tools", [{"type": "function", "function": {"name": "f", "description": 3}}], "tools[0]", "description"),
    ],
)
def test_bad_parameters_and_histories_are_400s_naming_the_field(served_roomy, field, value, param, phrase):
    session = served_roomy.loop.sessions.open()
    body = {"messages": MESSAGES, "max_tokens": 2, field: value}
    refused = httpx.post(chat_url(served_roomy, session), json=body, headers=headers(session), timeout=60)
    assert_refused(refused, param, phrase)


def test_a_conversation_the_chat_template_refuses_is_a_400(served_roomy, monkeypatch):
    def refuses(*args, **kwargs):
        raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")

    monkeypatch.setattr(served_roomy.loop.tokenizer, "apply_chat_template", refuses)
    session = served_roomy.loop.sessions.open()
    refused = httpx.post(chat_url(served_roomy, session), json={"messages": MESSAGES}, headers=headers(session))
    assert_refused(refused, "messages", "chat template cannot render", "must alternate")


def test_a_failure_of_the_server_is_a_500_error_object_for_that_request_alone(served_roomy, monkeypatch, caplog):
    completions = served_roomy.loop.completions
    sample = completions.sample

    async def fails_on_request(context, *args):
        if "fail" in context.text:
            raise RuntimeError("engine down")
        return await sample(context, *args)

    monkeypatch.setattr(completions, "sample", fails_on_request)
    session = served_roomy.loop.sessions.open()
    with httpx.Client(timeout=60, headers=headers(session)) as client:
        url = chat_url(served_roomy, session)
        failed = client.post(url, json={"messages": [{"role": "user", "content": "fail"}], "max_tokens": 2})
        assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
        assert "engine down" not in failed.text  # the details are the server's log's, not the client's
        assert client.post(url, json={"messages": MESSAGES, "max_tokens": 2}).status_code == 200
    assert any("engine down" in str(record.exc_info) for record in caplog.records)


def test_leaving_loopback_needs_allow_remote_and_says_what_it_exposes():
    with pytest.raises(ConfigError, match=r"endpoint.host \('0.0.0.0'\) is not a loopback address.*allow_remote"):
        load_config(None, ["task.name=calculator", "endpoint.host=0.0.0.0"])
    config = load_config(None, ["task.name=calculator", "endpoint.host=0.0.0.0", "endpoint.allow_remote=true"])
    assert config.endpoint.host == "0.0.0.0" and config.endpoint.allow_remote
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert load_config(None, ["task.name=calculator", f"endpoint.host={host}"]).endpoint.host == host
    for host in ("", "10.0.0.1", "example.org"):
        with pytest.raises(ValueError, match="allow_remote"):
            EndpointServer(None, None, host=host)
    notice = exposure("http://0.0.0.0:8000")
    assert "other machines" in notice and "bearer key" in notice and "not encrypted" in notice


def test_a_prompt_longer_than_the_tokenizers_limit_logs_no_tokenizer_warning(caplog):
    """The endpoint measures a prompt against the context itself; the tokenizer's own warning (emitted once per
    tokenizer, so whether another test saw it first would decide) stays out of the server log."""
    tokenizer = build_tokenizer()
    text = "1" * (tokenizer.model_max_length + 10)
    with caplog.at_level(logging.WARNING):
        ids = tokenize(tokenizer, text)
    assert len(ids) > tokenizer.model_max_length
    assert not caplog.records, [record.getMessage() for record in caplog.records]
