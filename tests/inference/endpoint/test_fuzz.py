"""Thousands of random and hostile request bodies (seeded mutations of valid requests) against a real endpoint on
loopback: none is answered with a 5xx or leaves a traceback in the server's log, every refusal is an OpenAI error
object, and the valid requests other sessions send meanwhile are all answered."""

import asyncio
import json
import logging
import random

import httpx
import pytest

from tests.helpers.endpoint import make_loop
from tests.inference.endpoint.conftest import serving

BODIES = 2400
AT_ONCE = 24  # fuzzed bodies sent together, with one valid request of each victim session
VICTIMS = 2
MESSAGES = [{"role": "user", "content": "What is 2*3?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
RAW = "\x00raw\x00"  # a placeholder replaced by JSON text json.dumps cannot write (NaN, 1e999, deep nesting)
RAW_TEXTS = [
    "NaN",
    "Infinity",
    "-Infinity",
    "1e999",
    "-0.0",
    "9" * 5000,
    "[" * 3000 + "]" * 3000,
    '{"a":' * 300 + "1" + "}" * 300,
]
VALUES = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2,
    17,
    2**31,
    2**63,
    10**40,
    -(10**40),
    0.0,
    1e-300,
    -1e-300,
    5e-324,
    0.009,
    0.5,
    2.0000001,
    1e308,
    "",
    "x",
    "auto",
    "none",
    "required",
    "text",
    "\u0000\ud7ff\U0001f600",
    "x" * 20_000,
    [],
    [""],
    ["x"] * 40,
    [None],
    [1, 2],
    [[]],
    {},
    {"type": "text"},
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
    {"include_usage": "yes"},
    {"a": {"b": {"c": [1, {"d": None}]}}},
    RAW,
]
ROLES = ["user", "assistant", "system", "developer", "tool", "function", "", None, 5, ["user"], {"role": "user"}]
ARGUMENTS = [
    "{not json",
    '{"x": ' + "9" * 4301 + "}",
    "[" * 5000 + "]" * 5000,
    '{"a": ' * 70 + "1" + "}" * 70,
    "[1, 2]",
    '"text"',
    "null",
    "",
    '{"expression": "2*3"}',
    {"expression": "2*3"},
    ["x"],
    5,
    None,
    {"deep": [[[[[[]]]]]]},
]
CHAT_FIELDS = [
    "model",
    "n",
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "stream",
    "stream_options",
    "user",
    "metadata",
    "store",
    "frequency_penalty",
    "presence_penalty",
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "logprobs",
    "top_logprobs",
    "response_format",
    "seed",
    "functions",
    "unknown_field",
]
COMPLETION_FIELDS = ["prompt", "n", "temperature", "top_p", "max_tokens", "stop", "echo", "logprobs", "stream", "x"]


def tool_call(random_):
    return {
        "id": random_.choice(["call_1", 5, None]),
        "type": random_.choice(["function", "x", None]),
        "function": random_.choice(
            [
                {"name": random_.choice(["calculator", "", 5, None]), "arguments": random_.choice(ARGUMENTS)},
                {"arguments": "{}"},
                "calculator",
                None,
            ]
        ),
    }


def a_message(random_):
    message = {"role": random_.choice(ROLES), "content": random_.choice([*VALUES, [{"type": "text", "text": "hi"}]])}
    if random_.random() < 0.5:
        message["tool_calls"] = random_.choice(
            [[tool_call(random_) for _ in range(random_.randint(1, 3))], random_.choice(VALUES)]
        )
    if random_.random() < 0.2:
        message[random_.choice(["name", "tool_call_id", "refusal", "audio"])] = random_.choice(VALUES)
    return message


def a_tool(random_):
    return random_.choice(
        [
            {"type": "function", "function": {"name": random_.choice(["f", "", 5]), **random_.choice(TOOL_PARTS)}},
            {"type": random_.choice(["retrieval", None, 5]), "function": {"name": "f"}},
            random_.choice(VALUES),
        ]
    )


TOOL_PARTS = [
    {},
    {"description": 5},
    {"parameters": []},
    {"parameters": {"properties": 5}},
    {"parameters": {"properties": {"a": 5}}},
    {"parameters": {"properties": {"a": {"type": ["x", {"y": None}]}}}},
    {"parameters": {"type": "object", "properties": {"a": {"type": "string"}}}, "description": "ok"},
]


def mutated(random_, chat: bool) -> bytes:
    """A body derived from a valid request by a few random mutations (a tenth left valid)."""
    if random_.random() < 0.03:  # not a request at all
        return random_.choice([b"", b"{", b"null", b"[]", b'"x"', b"\xff\xfe\x00", b"{}" * 100, b'{"messages": '])
    body = (
        {"messages": list(MESSAGES), "max_tokens": 1}
        if chat
        else {"prompt": random_.choice(["ai", [4, 5, 6]]), "max_tokens": 1}
    )
    if random_.random() < 0.1:
        return json.dumps(body).encode()
    fields = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for _ in range(random_.randint(1, 3)):
        kind = random_.random()
        if kind < 0.45:
            body[random_.choice(fields)] = random_.choice(VALUES)
        elif kind < 0.5:
            body.pop(random_.choice(list(body)), None)
        elif chat and kind < 0.8:
            messages = body.get("messages") if isinstance(body.get("messages"), list) else list(MESSAGES)
            messages.insert(random_.randint(0, len(messages)), a_message(random_))
            body["messages"] = messages
        elif chat and kind < 0.92:
            body["tools"] = [a_tool(random_) for _ in range(random_.randint(1, 3))] if random_.random() < 0.8 else TOOLS
        elif not chat:
            body["prompt"] = random_.choice([[-1], [10**12], [[1]], ["a"], [], "", [4] * 5000, *VALUES])
        else:
            body["messages"] = [{"role": "user", "content": {"nested": [MESSAGES] * 3}}]
    text = json.dumps(body)
    while json.dumps(RAW) in text:
        text = text.replace(json.dumps(RAW), random_.choice(RAW_TEXTS), 1)
    return text.encode()


class Records(logging.Handler):
    """Every warning or error the server logs, and whatever carries a traceback."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        if record.levelno >= logging.WARNING or record.exc_info:
            self.records.append(record)


@pytest.fixture(scope="module")
def endpoint(policy):
    with serving(make_loop(policy, max_body_bytes=1 << 15, max_n=2)) as running:
        yield running


def test_hostile_bodies_get_4xx_errors_and_leave_other_sessions_requests_unaffected(endpoint, capfd):
    records = Records()
    loggers = [logging.getLogger(name) for name in ("", "uvicorn", "uvicorn.error", "uvicorn.access")]
    for logger in loggers:
        logger.addHandler(records)
    random_ = random.Random(0)
    sessions = endpoint.loop.sessions
    fuzzed = [sessions.open(order) for order in range(4)]
    victims = [sessions.open(order) for order in range(4, 4 + VICTIMS)]
    server = endpoint.loop.server
    statuses, victim_statuses = {}, []

    def target(session):
        """Most bodies go to a session; some to the run's /v1 and some with a wrong key."""
        draw = random_.random()
        if draw < 0.1:
            return f"{server.base_url}/v1", server.token
        if draw < 0.13:
            return server.session_url(session.id), "wrong"
        return server.session_url(session.id), session.key

    async def send(client, base, key, route, body):
        response = await client.post(
            f"{base}/{route}",
            content=body,
            headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
        )
        await response.aread()
        return response

    async def fuzz():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=AT_ONCE + VICTIMS)) as client:
            for start in range(0, BODIES, AT_ONCE):
                requests = []
                for index in range(start, min(start + AT_ONCE, BODIES)):
                    chat = random_.random() < 0.75
                    body = mutated(random_, chat)
                    base, key = target(fuzzed[index % len(fuzzed)])
                    requests.append(send(client, base, key, "chat/completions" if chat else "completions", body))
                valid = json.dumps({"messages": MESSAGES, "max_tokens": 2, "temperature": 0.7}).encode()
                for victim in victims:
                    requests.append(send(client, server.session_url(victim.id), victim.key, "chat/completions", valid))
                responses = await asyncio.gather(*requests)
                for response in responses[: len(responses) - VICTIMS]:
                    statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                    assert response.status_code < 500, response.text
                    if response.status_code >= 400:
                        error = response.json()["error"]
                        assert set(error) == {"message", "type", "param", "code"} and error["message"]
                victim_statuses.extend(response.status_code for response in responses[-VICTIMS:])

    try:
        asyncio.run(fuzz())
    finally:
        for logger in loggers:
            logger.removeHandler(records)
    sent = -(-BODIES // AT_ONCE)
    assert victim_statuses == [200] * (sent * VICTIMS)
    assert all(victim.calls == sent for victim in victims)
    assert not [record.getMessage() for record in records.records]
    assert "Traceback" not in capfd.readouterr().err
    print(statuses)
    assert statuses.get(200, 0) > BODIES // 20 and statuses.get(400, 0) > BODIES // 2  # both kinds were exercised
