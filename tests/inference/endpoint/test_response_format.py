"""``response_format`` json_object and json_schema over HTTP on the hf engine: the untrained policy's reply is
JSON that matches the schema (constrained decoding), a reply ``max_tokens`` cuts finishes with "length", the
session records the masked distribution's log-probs, and a form or schema that cannot be honoured is a 400."""

import json

import httpx
import jsonschema
import pytest
import torch
from openai import OpenAI

from tests.helpers.endpoint import RecordingEngine
from tests.inference.endpoint.conftest import serving
from unipg.config.lm import EndpointConfig
from unipg.inference import SamplingParams
from unipg.sample.endpoint_agents import ExternalAgentLoop

MESSAGES = [{"role": "user", "content": "Is 2*3 six? Answer in JSON."}]
MAX_TOKENS = 64  # room for an untrained policy's JSON object (one token per character)
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "boolean"}, "unit": {"enum": ["m", "s"]}},
    "required": ["answer", "unit"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def served_json(policy):
    """An endpoint whose replies may be ``MAX_TOKENS`` long."""
    engine = RecordingEngine(policy, SamplingParams(), generator=torch.Generator().manual_seed(0), batch_wait=0.005)
    loop = ExternalAgentLoop(
        engine,
        policy.tokenizer,
        eos_ids=policy.eos_ids,
        endpoint=EndpointConfig(max_n=4),
        max_tokens=MAX_TOKENS,
        context_length=policy.context_length,
        describe_tools=True,
    )
    with serving(loop) as running:
        yield running


def session_client(served):
    session = served.loop.sessions.open()
    return session, OpenAI(base_url=served.loop.server.session_url(session.id), api_key=session.key, max_retries=0)


def test_a_json_schema_reply_matches_the_schema_and_records_the_masked_logprobs(served_json):
    session, client = session_client(served_json)
    reply = client.chat.completions.create(
        model="unipg", messages=MESSAGES, response_format=JSON_SCHEMA, n=2, seed=3, logprobs=True
    )
    assert len(session.trajectories) == 2
    for choice, trajectory in zip(reply.choices, session.trajectories):
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        logprobs = [entry.logprob for entry in choice.logprobs.content]
        assert trajectory.behaviour_logprobs == logprobs and trajectory.loss_mask == [1] * len(logprobs)
        # the grammar leaves one token after '{': its masked probability is 1, whatever the policy's
        assert choice.logprobs.content[1].token == '"' and logprobs[1] == 0.0


def test_a_json_object_reply_is_a_json_object_unless_max_tokens_cuts_it(served_json):
    _, client = session_client(served_json)
    reply = client.chat.completions.create(
        model="unipg", messages=MESSAGES, response_format={"type": "json_object"}, n=4, seed=0, temperature=0.7
    )
    finishes = [choice.finish_reason for choice in reply.choices]
    assert "stop" in finishes, finishes
    for choice in reply.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.finish_reason == "length" and choice.message.content.startswith("{")


def test_a_reply_max_tokens_cuts_finishes_with_length_and_unfinished_json(served_json):
    _, client = session_client(served_json)
    reply = client.chat.completions.create(model="unipg", messages=MESSAGES, response_format=JSON_SCHEMA, max_tokens=5)
    [choice] = reply.choices
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 5
    assert '{"answer":'.startswith(choice.message.content) or '{"unit":'.startswith(choice.message.content)


def test_a_text_response_format_changes_nothing(served_json):
    _, client = session_client(served_json)
    reply = client.chat.completions.create(
        model="unipg", messages=MESSAGES, response_format={"type": "text"}, max_tokens=4, seed=1
    )
    plain = client.chat.completions.create(model="unipg", messages=MESSAGES, max_tokens=4, seed=1)
    assert reply.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize(
    "response_format, phrase",
    [
        ({"type": "xml"}, "response_format must be"),
        ("json_object", "response_format must be"),
        ({"type": "json_object", "schema": SCHEMA}, "response_format must be"),
        ({"type": "json_schema"}, "response_format must be"),
        ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "json_schema.name must be"),
        ({"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}, "json_schema.name must be"),
        ({"type": "json_schema", "json_schema": {"name": "v"}}, "json_schema.schema must be"),
        ({"type": "json_schema", "json_schema": {"name": "v", "schema": SCHEMA, "strict": "yes"}}, "strict a boolean"),
        ({"type": "json_schema", "json_schema": {"name": "v", "schema": {"type": "foo"}}}, "Invalid schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "v", "schema": {"type": "number", "multipleOf": 2}}},
            "'multipleOf' is not enforced",
        ),
    ],
)
def test_a_response_format_that_cannot_be_honoured_is_a_400_naming_it(served_json, response_format, phrase):
    session = served_json.loop.sessions.open()
    refused = httpx.post(
        f"{served_json.loop.server.session_url(session.id)}/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 2, "response_format": response_format},
        headers={"authorization": f"Bearer {session.key}"},
        timeout=60,
    )
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "response_format" and phrase in error["message"], error
    assert error["type"] == "invalid_request_error" and session.calls == 0


def test_a_json_reply_cannot_be_forced_to_open_a_tool_call(served_json):
    session = served_json.loop.sessions.open()
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}
    refused = httpx.post(
        f"{served_json.loop.server.session_url(session.id)}/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {session.key}"},
        timeout=60,
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format", refused.text
