"""Requests answered as OpenAI answers them: a model by name, unknown paths and methods, a model the endpoint does not
serve, a tool message answering no call, and a max_tokens past the model's context."""

import httpx
import openai
import pytest
from openai import OpenAI

from tests.helpers.endpoint import make_loop
from tests.inference.endpoint.conftest import serving

MESSAGES = [{"role": "user", "content": "What is 2*3?"}]
CALL = {"id": "call_7", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2*3"}'}}


def clients(served):
    """A session's client and the run's (``/v1``) client."""
    server, session = served.loop.server, served.loop.sessions.open()
    mine = OpenAI(base_url=server.session_url(session.id), api_key=session.key, max_retries=0)
    return session, mine, OpenAI(base_url=f"{server.base_url}/v1", api_key=server.token, max_retries=0)


def error_of(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_a_model_is_retrieved_by_name_under_v1_and_under_a_session(served):
    _, mine, run = clients(served)
    for client in (mine, run):
        model = client.models.retrieve("unipg")
        assert (model.id, model.object) == ("unipg", "model")
        with pytest.raises(openai.NotFoundError) as missing:
            client.models.retrieve("gpt-4o")
        assert missing.value.code == "model_not_found" and "'unipg'" in missing.value.message


def test_a_request_for_a_model_not_served_is_a_404_model_not_found(served):
    session, mine, _ = clients(served)
    with pytest.raises(openai.NotFoundError) as chat:
        mine.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.NotFoundError) as text:
        mine.completions.create(model="org/other", prompt="ai", max_tokens=2)
    for refused in (chat, text):
        assert refused.value.code == "model_not_found" and "serves 'unipg'" in refused.value.message
    assert session.calls == 0


def test_any_model_name_answers_every_name(policy):
    with serving(make_loop(policy, any_model_name=True)) as running:
        _, mine, _ = clients(running)
        assert mine.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2).choices
        assert mine.models.retrieve("org/name").id == "org/name"


def test_unknown_paths_and_methods_are_404_and_405_error_objects(served):
    base, token = served.loop.server.base_url, served.loop.server.token
    headers = {"authorization": f"Bearer {token}"}
    missing = httpx.post(f"{base}/v1/embeddings", json={}, headers=headers)
    assert error_of(missing, 404)["message"] == "Invalid URL (POST /v1/embeddings)"
    wrong = httpx.get(f"{base}/v1/chat/completions", headers=headers)
    assert error_of(wrong, 405)["message"] == "Invalid method for URL (GET /v1/chat/completions)"
    assert wrong.headers["allow"] == "POST"
    with pytest.raises(openai.NotFoundError):
        clients(served)[1].embeddings.create(model="unipg", input="x")


@pytest.mark.parametrize(
    "history, param, phrase",
    [
        ([{"role": "tool", "tool_call_id": "call_7", "content": "6"}], "messages[1].tool_call_id", "matches no tool"),
        (
            [{"role": "assistant", "content": None, "tool_calls": [CALL]}, {"role": "tool", "content": "6"}],
            "messages[2].tool_call_id",
            "is required",
        ),
        (
            [
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_8", "content": "6"},
            ],
            "messages[2].tool_call_id",
            "'call_8' matches no tool call",
        ),
    ],
)
def test_a_tool_message_that_answers_no_earlier_call_is_a_400_naming_its_tool_call_id(served, history, param, phrase):
    session, mine, _ = clients(served)
    with pytest.raises(openai.BadRequestError) as refused:
        mine.chat.completions.create(model="unipg", messages=[*MESSAGES, *history], max_tokens=2)
    assert refused.value.param == param and phrase in refused.value.message
    answered = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [CALL]}]
    answered.append({"role": "tool", "tool_call_id": "call_7", "content": "6"})
    assert mine.chat.completions.create(model="unipg", messages=answered, max_tokens=2).choices
    assert session.calls == 1


def test_max_tokens_past_the_context_is_a_400_and_no_reply_is_shortened_to_fit(served):
    session, mine, _ = clients(served)
    context = served.loop.completions.limits.context_length
    with pytest.raises(openai.BadRequestError) as refused:
        mine.chat.completions.create(model="unipg", messages=MESSAGES, max_tokens=context)
    error = refused.value
    assert error.code == "context_length_exceeded" and error.param == "messages"
    tokenizer = served.loop.tokenizer
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    length = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert (
        f"maximum context length is {context} tokens. However, you requested {length + context} tokens "
        f"({length} in the prompt, {context} in the completion)"
    ) in error.message
    prompt = [4] * (context - 3)
    with pytest.raises(openai.BadRequestError, match="you requested 513 tokens"):
        mine.completions.create(model="unipg", prompt=prompt, max_tokens=4)
    reply = mine.completions.create(model="unipg", prompt=prompt, max_tokens=3)  # fits exactly
    assert reply.usage.completion_tokens <= 3 and session.calls == 1
