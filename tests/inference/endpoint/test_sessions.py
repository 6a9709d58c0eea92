"""Calls of a session join into one trajectory token-exactly, also where the tokenizer does not round-trip."""

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from unipg.inference import TurnOutput
from unipg.inference.endpoint.render import ToolCallFormat, plain_messages, render_conversation, reply_key
from unipg.inference.endpoint.sessions import Session
from unipg.policy.embedded import CHAT_TEMPLATE

SPECIALS = ["<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]


@pytest.fixture(scope="module")
def bpe():
    """A BPE whose canonical split of "ab" is one token, while a model may sample "a" then "b"."""
    vocab = {token: index for index, token in enumerate(SPECIALS + list("abcdefghijklmnopqrstuvwxyz0123456789 ?"))}
    vocab["ab"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIALS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|end|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def turn(token_ids, text):
    return TurnOutput(token_ids, [-0.5] * len(token_ids), text, "stop", True, 3)


def follow_up(session, tokenizer, history):
    text = render_conversation(tokenizer, plain_messages(history, session.raw_replies, ToolCallFormat()), None)
    return session.context(text)


def test_a_reply_sent_back_continues_with_the_sampled_ids_not_a_re_tokenisation(bpe):
    a, b, end = bpe.convert_tokens_to_ids(["a", "b", "<|end|>"])
    assert ids(bpe, "ab") == [bpe.convert_tokens_to_ids("ab")]  # decode -> encode would merge a, b
    session = Session("s", bpe, eos_ids=[end])
    history = [{"role": "user", "content": "c?"}]
    first = follow_up(session, bpe, history)
    assert first.trajectory is None and first.ids == ids(bpe, "<|user|>c?<|end|><|assistant|>")
    sampled = turn([a, b, end], "ab")
    session.record(first, [sampled])
    session.remember_reply(reply_key("ab", []), sampled.token_ids)
    history += [{"role": "assistant", "content": "ab"}, {"role": "user", "content": "7"}]
    second = follow_up(session, bpe, history)
    [trajectory] = session.trajectories
    assert second.trajectory is trajectory
    assert second.ids == first.ids + [a, b, end] + ids(bpe, "<|user|>7<|end|><|assistant|>")
    session.record(second, [turn([b, end], "b")])
    assert session.trajectories == [trajectory] and trajectory.turns == 2
    assert trajectory.ids == second.ids + [b, end]
    assert trajectory.loss_mask == [1, 1, 1] + [0] * len(second.inserted) + [1, 1]
    assert trajectory.behaviour_logprobs == [-0.5] * 3 + [0.0] * len(second.inserted) + [-0.5] * 2
    assert trajectory.turn_of_token == [0, 0, 0] + [-1] * len(second.inserted) + [1, 1]
    assert trajectory.policy_versions == [3, 3]


def test_a_reply_cut_before_eos_gets_the_end_of_turn_as_an_observation_token(bpe):
    a, b, end = bpe.convert_tokens_to_ids(["a", "b", "<|end|>"])
    session = Session("s", bpe, eos_ids=[end])
    history = [{"role": "user", "content": "c?"}]
    first = follow_up(session, bpe, history)
    session.record(first, [TurnOutput([a, b], [-1.0, -1.0], "ab", "length", False, 0)])
    session.remember_reply(reply_key("ab", []), [a, b])
    second = follow_up(
        session, bpe, history + [{"role": "assistant", "content": "ab"}, {"role": "user", "content": "d"}]
    )
    assert second.trajectory is session.trajectories[0]
    assert second.inserted[0] == end and second.ids[: len(first.ids) + 2] == first.ids + [a, b]


def test_a_call_that_rewrites_history_starts_a_new_trajectory_of_the_session(bpe):
    a, end = bpe.convert_tokens_to_ids(["a", "<|end|>"])
    session = Session("s", bpe, eos_ids=[end])
    first = follow_up(session, bpe, [{"role": "user", "content": "c?"}])
    session.record(first, [turn([a, end], "a")])
    other = follow_up(session, bpe, [{"role": "user", "content": "d?"}])
    assert other.trajectory is None
    session.record(other, [turn([a, end], "a"), turn([a, a, end], "aa")])  # n = 2: each choice its own
    assert len(session.trajectories) == 3 and session.last is session.trajectories[1]


def test_hermes_calls_are_parsed_and_written_back_the_same_way():
    calls_format = ToolCallFormat()
    text = 'let me see <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
    content, [call] = calls_format.parse(text)
    assert (
        content == "let me see" and call.name == "calculator" and call.key() == ("calculator", '{"expression": "2*3"}')
    )
    assert calls_format.parse(calls_format.format([call]))[1] == [call]
    assert calls_format.parse("<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])


def test_the_runs_tool_parser_sets_the_endpoints_call_format(bpe):
    from unipg.inference.endpoint.protocol import Completions, Limits

    completions = Completions(None, bpe, Limits(max_tokens=8), tool_parser="llama3_json")
    content, [call] = completions.calls_format.parse('{"name": "calculator", "parameters": {"expression": "2*3"}}')
    assert content == "" and call.key() == ("calculator", '{"expression": "2*3"}')
    assert completions.calls_format.close is None  # the call is the whole turn: no closing tag to stop at


def test_a_tool_call_sent_back_as_openai_tool_calls_continues_the_trajectory(bpe):
    end = bpe.convert_tokens_to_ids("<|end|>")
    session = Session("s", bpe, eos_ids=[end])
    history = [{"role": "user", "content": "c?"}]
    first = follow_up(session, bpe, history)
    sampled_text = '<tool_call>{"name": "f", "arguments": {"x": "ab"}}</tool_call>'
    sampled = bpe.convert_tokens_to_ids(["a", "b"])  # the model's ids, whatever text the reply decodes to
    raw = session.raw_text(sampled)
    content, calls = ToolCallFormat().parse(sampled_text)
    session.record(first, [turn(sampled + [end], sampled_text)])
    session.remember_reply(reply_key(content, calls), sampled + [end])
    returned = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x":"ab"}'}}],
    }
    second = follow_up(session, bpe, history + [returned, {"role": "tool", "tool_call_id": "call_1", "content": "7"}])
    assert second.trajectory is session.trajectories[0] and raw == "ab"  # the sampled text stands in for the call
    assert session.raw_replies[reply_key(content, calls)] == raw
    assert second.ids == first.ids + sampled + [end] + ids(bpe, "<|tool|>7<|end|><|assistant|>")


def test_a_text_prompt_holding_a_reply_without_its_eos_continues_the_trajectory_after_the_eos(bpe):
    a, b, end = bpe.convert_tokens_to_ids(["a", "b", "<|end|>"])
    session = Session("s", bpe, eos_ids=[end])
    first = session.context("c?")
    session.record(first, [turn([a, b, end], "ab")])  # a text completion returns "ab": the EOS has no text there
    [trajectory] = session.trajectories
    second = session.context("c?ab d")
    assert second.trajectory is trajectory and second.ids == first.ids + [a, b, end] + ids(bpe, " d")
    session.record(second, [turn([b], "b")])
    assert trajectory.loss_mask == [1, 1, 1] + [0] * len(ids(bpe, " d")) + [1] and trajectory.turns == 2
    assert session.context("c?ab dbe").trajectory is trajectory  # the text holds no EOS: it goes on as ever
    assert session.context("c?abd").trajectory is None  # the EOS is not the reply's last token any more


def test_a_prompt_of_just_the_reply_continues_after_its_eos_but_an_eos_only_reply_does_not(bpe):
    a, end = bpe.convert_tokens_to_ids(["a", "<|end|>"])
    session = Session("s", bpe, eos_ids=[end])
    session.record(session.context("c?"), [turn([a, end], "a")])
    assert session.context("c?a").inserted == [] and session.context("c?a").trajectory is not None
    assert session.context("c?a<|end|>").inserted == []  # the prompt writes the EOS itself: not twice
    held = session.trajectories[0].ids
    assert session.context("", held[:-1] + [a]).ids == held + [a]  # token ids: the same, after the sampled EOS
    assert session.context("", held).ids == held
    empty = Session("s", bpe, eos_ids=[end])
    empty.record(empty.context("c?"), [turn([end], "")])
    assert empty.context("c?").trajectory is None  # the same prompt again is a new sample, not a continuation
