"""The endpoint over real HTTP with the real openai client (sync and async), and what it refuses."""

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

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


def session_client(served, session=None):
    session = session or served.loop.sessions.open()
    return session, OpenAI(base_url=served.loop.server.session_url(session.id), api_key=session.key, max_retries=0)


def test_binds_loopback_on_a_free_port_by_default(served):
    assert served.loop.server.base_url.startswith("http://127.0.0.1:")
    assert not served.loop.server.base_url.endswith(":0")


def test_connections_send_small_writes_at_once(served):
    """Nagle's algorithm is off on the server's side of every connection: a response written as headers then
    body is not held back waiting for the client's delayed ACK."""
    import socket

    session, client = session_client(served)
    client.models.list()

    async def nodelay():
        return [
            connection.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            for connection in served.loop.server.http.server_state.connections
        ]

    flags = served.call(nodelay())
    assert flags and all(flags)


def test_sync_client_chat_with_tools_logprobs_and_n_is_recorded_in_the_session(served):
    session, client = session_client(served)
    reply = client.chat.completions.create(
        model="unipg", messages=MESSAGES, tools=TOOLS, logprobs=True, n=2, temperature=0.7, top_p=0.9, max_tokens=5
    )
    assert len(reply.choices) == 2 and len(session.trajectories) == 2
    for choice, trajectory in zip(reply.choices, session.trajectories):
        assert [entry.logprob for entry in choice.logprobs.content] == trajectory.behaviour_logprobs
        assert len(trajectory.token_ids) <= 5 and reply.usage.prompt_tokens == len(trajectory.prompt_ids)
    assert "calculator" in served.loop.tokenizer.decode(session.trajectories[0].prompt_ids)  # tools described


def test_async_client_continuing_a_reply_extends_one_trajectory(served):
    session = served.loop.sessions.open()
    client = AsyncOpenAI(base_url=served.loop.server.session_url(session.id), api_key=session.key, max_retries=0)

    async def two_turns():
        first = await client.chat.completions.create(model="unipg", messages=MESSAGES, max_completion_tokens=6)
        history = MESSAGES + [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "sure?"},
        ]
        return await client.chat.completions.create(model="unipg", messages=history, max_tokens=6)

    served.call(two_turns())
    [trajectory] = session.trajectories
    assert trajectory.turns == 2 and trajectory.loss_mask.count(0) > 0


def test_text_completions_with_token_ids_and_the_models_list(served):
    session, client = session_client(served)
    first = client.completions.create(model="unipg", prompt=[4, 5, 6], max_tokens=3, logprobs=0)
    assert first.choices[0].logprobs.token_logprobs == session.trajectories[0].behaviour_logprobs
    client.completions.create(model="unipg", prompt=session.trajectories[0].ids + [7], max_tokens=3)
    assert len(session.trajectories) == 1 and session.trajectories[0].turns == 2
    assert [model.id for model in client.models.list().data] == ["unipg"]


def test_a_text_completion_continuing_a_reply_that_ended_on_eos_extends_its_trajectory(served):
    session, client = session_client(served)
    first = client.completions.create(model="unipg", prompt="ai", max_tokens=6, temperature=0.0)
    [trajectory] = session.trajectories
    eos = served.loop.sessions.eos_ids
    assert first.choices[0].finish_reason == "stop" and trajectory.token_ids[-1] in eos  # greedy: one token, EOS
    sampled = list(trajectory.token_ids)
    client.completions.create(model="unipg", prompt="ai" + first.choices[0].text + " 7", max_tokens=2)
    assert session.trajectories == [trajectory] and trajectory.turns == 2
    inserted = served.loop.tokenizer(" 7", add_special_tokens=False)["input_ids"]
    assert trajectory.token_ids[: len(sampled) + len(inserted)] == sampled + inserted  # the EOS kept, as sampled
    assert trajectory.loss_mask[: len(sampled) + len(inserted)] == [1] * len(sampled) + [0] * len(inserted)


def test_unsupported_fields_are_refused_naming_the_field(served):
    _, client = session_client(served)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="unipg", messages=MESSAGES, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.completions.create(model="unipg", prompt="x", stream=True)


def test_a_streamed_chat_reply_is_the_recorded_reply_in_chunks(served):
    session, client = session_client(served)
    chunks = list(
        client.chat.completions.create(
            model="unipg", messages=MESSAGES, max_tokens=6, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    [trajectory] = session.trajectories
    assert text == trajectory.turn_texts[0] and chunks[-1].usage.completion_tokens == len(trajectory.token_ids)
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] in ("stop", "length")


def test_requests_without_the_right_key_are_refused(served):
    server = served.loop.server
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{server.base_url}/v1/models").status_code == 401
    run_client = OpenAI(base_url=f"{server.base_url}/v1", api_key=server.token, max_retries=0)
    assert run_client.chat.completions.create(model="unipg", messages=MESSAGES, max_tokens=2).choices


def test_one_session_cannot_write_to_another(served):
    mine, _ = session_client(served)
    theirs = served.loop.sessions.open()
    intruder = OpenAI(base_url=served.loop.server.session_url(theirs.id), api_key=mine.key, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        intruder.chat.completions.create(model="unipg", messages=MESSAGES, max_tokens=2)
    assert theirs.trajectories == [] and theirs.calls == 0
    with pytest.raises(openai.AuthenticationError):  # nor read, nor write, with the run's token
        OpenAI(
            base_url=served.loop.server.session_url(theirs.id), api_key=served.loop.server.token, max_retries=0
        ).models.list()


def test_bodies_and_generated_lengths_are_bounded(served):
    session, client = session_client(served)
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="unipg", messages=[{"role": "user", "content": "x" * 10_000}])
    assert refused.value.status_code == 413
    reply = client.chat.completions.create(model="unipg", messages=MESSAGES, max_tokens=100)
    assert reply.usage.completion_tokens <= 12  # the endpoint's limit
    with pytest.raises(openai.BadRequestError, match="n"):
        client.chat.completions.create(model="unipg", messages=MESSAGES, n=5)


def test_the_same_seed_and_body_get_the_same_reply_and_the_choices_of_one_request_differ(served):
    """At temperature 1, in another session (another place in the engine's batches): the seed alone decides."""
    replies = []
    for seed in (7, 7, 8):
        _, client = session_client(served)
        reply = client.chat.completions.create(
            model="unipg", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=seed, n=2, logprobs=True
        )
        replies.append([(choice.message.content, choice.logprobs.content) for choice in reply.choices])
    first, again, other = replies
    assert again == first and other != first
    assert first[0] != first[1]
    completion = session_client(served)[1].completions.create
    texts = [completion(model="unipg", prompt="ai", max_tokens=8, seed=5).choices[0].text for _ in range(2)]
    assert texts[0] == texts[1]
