"""Sessions: every call of one episode recorded token for token, and joined into trajectories.

A call's context is token ids; what the engine sampled is kept as ids with their behaviour log-probs and
policy version, never re-tokenised. A call *extends* a trajectory of its session when its rendered prompt
text starts with everything that trajectory holds so far (its prompt, what the agent added, the model's
replies). The new context is then that trajectory's ids followed by the tokens of the rest of the prompt
only (the agent's additions: the end of the assistant turn, tool results, user messages), which are
observation tokens (loss mask 0). A reply that ended on EOS is also extended by a prompt holding the reply
without the EOS (what a text completion returns): the sampled EOS stays, the rest of the prompt follows it.
A call that extends no trajectory starts a new one of the same episode.

The text a trajectory is compared with is built from the sampled ids themselves (decoded with special
tokens kept, the final EOS as the tokenizer writes it), so the comparison holds whatever the tokenizer would
make of that text: a BPE that would split a sampled word differently still extends the trajectory, and
the ids stay the sampled ones.

A chat call that extends a trajectory also brings what the agent added after the model's last reply, as
messages: those are the reply's *observations* (``SessionTrajectory.observations``), the results of the tool
calls the agent ran (each with the call it answers) and any user message, which the episode's record and tool
metrics read as the built-in agent loop's.

A session is found by its key alone (``Sessions.by_key``): every episode's agent calls one base URL and only its
key differs. Keys are looked up by their SHA-256 digest, so how long a lookup takes depends on the digest, not on
how many leading characters of a real key a caller guessed.
"""

from __future__ import annotations

import hashlib
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field

from unipg.inference import TurnOutput
from unipg.inference.endpoint.render import ToolCall, content_text, message_calls, reply_key

KEY_BYTES = 24  # random bytes of a session's key


def tokenize(tokenizer, text: str) -> list[int]:
    """``text``'s token ids, no special tokens added. The endpoint measures a prompt against the model's context
    itself (a 400 naming both lengths), so the tokenizer's warning about its ``model_max_length`` is not logged."""
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


@dataclass(frozen=True)
class Observation:
    """A message the agent added after a reply of the model: a tool's result, or a user or system message."""

    role: str  # as the agent sent it: tool, user, system or developer
    content: str
    call: ToolCall | None = None  # the reply's tool call a ``tool`` message answers (None: another message)


@dataclass
class SessionTrajectory:
    """One sequence of calls of a session, each continuing the last one's reply."""

    prompt_ids: list[int]  # the first call's context
    text: str  # the rendered text of prompt + every token after it, compared with later prompts
    token_ids: list[int] = field(default_factory=list)  # every token after the prompt, sampled or inserted
    loss_mask: list[int] = field(default_factory=list)  # 1 on sampled tokens, 0 on the agent's additions
    behaviour_logprobs: list[float] = field(default_factory=list)  # log μ on sampled tokens, 0 elsewhere
    turn_of_token: list[int] = field(default_factory=list)  # call a sampled token belongs to; -1 inserted
    policy_versions: list[int] = field(default_factory=list)  # weights version of each call
    version_changes: list[tuple[int, int]] = field(default_factory=list)  # as ``Trajectory.version_changes``
    turn_texts: list[str] = field(default_factory=list)  # each call's reply text as returned
    finish_reasons: list[str] = field(default_factory=list)
    observations: dict[int, list[Observation]] = field(default_factory=dict)  # call → what the agent added
    # after its reply, as messages (a call continued by a text completion or by nothing has none)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.token_ids

    @property
    def turns(self) -> int:
        return len(self.turn_texts)

    def insert(self, token_ids: list[int]) -> None:
        self.token_ids += token_ids
        self.loss_mask += [0] * len(token_ids)
        self.behaviour_logprobs += [0.0] * len(token_ids)
        self.turn_of_token += [-1] * len(token_ids)

    def add_reply(self, output: TurnOutput, raw_text: str) -> None:
        turn = self.turns
        self.version_changes += [(len(self.token_ids) + offset, version) for offset, version in output.version_changes]
        self.token_ids += output.token_ids
        self.loss_mask += [1] * len(output.token_ids)
        self.behaviour_logprobs += output.behaviour_logprobs
        self.turn_of_token += [turn] * len(output.token_ids)
        self.policy_versions.append(output.policy_version)
        self.turn_texts.append(output.text)
        self.finish_reasons.append(output.finish_reason)
        self.text += raw_text


@dataclass
class Context:
    """Where a call's generation starts: its ids, and the trajectory it continues (None: a new one)."""

    ids: list[int]
    text: str
    trajectory: SessionTrajectory | None
    inserted: list[int]  # the tokens added after the trajectory's end (empty for a new trajectory)
    length: int  # len(trajectory.token_ids) when matched: a reply appends only if nothing came in between
    opening: list[int] = field(default_factory=list)  # a forced tool call's start, the last of ``ids``
    observations: list[Observation] = field(default_factory=list)  # what the agent added after the trajectory's
    # last reply (a chat call that continues it)

    def opened(self, opening_ids: list[int], opening_text: str) -> Context:
        """This context followed by the opening of a tool call the reply must make (``tool_choice``): tokens of
        the environment, inserted before the policy samples."""
        return Context(
            self.ids + opening_ids,
            self.text + opening_text,
            self.trajectory,
            self.inserted + opening_ids,
            self.length,
            list(opening_ids),
            self.observations,
        )


class Session:
    """The calls of one episode; reachable only with its own key."""

    def __init__(self, session_id: str, tokenizer, *, eos_ids: list[int], order: int = 0):
        """``order``: where the session's requests sit in a batch of the engine (reproducible batches)."""
        self.id, self.key, self.order = session_id, secrets.token_urlsafe(KEY_BYTES), order
        self.tokenizer, self.eos_ids = tokenizer, set(eos_ids)
        self.trajectories: list[SessionTrajectory] = []
        self.raw_replies: dict[tuple, str] = {}  # reply_key of a returned message → the text the model sampled
        self.last: SessionTrajectory | None = None  # the trajectory of the latest call (its first choice)
        self.calls = 0
        self.closed = False

    def tokenize(self, text: str) -> list[int]:
        return tokenize(self.tokenizer, text) if text else []

    def raw_text(self, token_ids: list[int]) -> str:
        """The sampled ids as the chat template writes a reply: special tokens kept, a final EOS as its own
        token text (the template's end of turn starts with it)."""
        ended = bool(token_ids) and token_ids[-1] in self.eos_ids
        body = token_ids[:-1] if ended else token_ids
        text = self.tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return text + (self.tokenizer.convert_ids_to_tokens(token_ids[-1]) if ended else "")

    def context(self, text: str, ids: list[int] | None = None, messages: list[dict] | None = None) -> Context:
        """The context of a call whose prompt renders to ``text`` (or is given as ``ids``): continuing the
        latest trajectory whose text (ids) it starts with, else a new trajectory. ``messages``: a chat call's
        (already checked), whose additions after the continued reply become its observations.

        A reply that ended on EOS is continued also by a prompt that holds the reply without it (a text
        completion returns the reply's text without the EOS, and an agent appends to that): the EOS was
        sampled, so it stays in the trajectory, and the prompt's rest follows it."""
        context = self._matching(text, ids)
        if context.trajectory is not None and messages:
            context.observations = self.added_messages(messages)
        return context

    def _matching(self, text: str, ids: list[int] | None) -> Context:
        """``context`` without observations."""
        for trajectory in reversed(self.trajectories):
            if not trajectory.turns:
                continue
            ended = self._ended_on_eos(trajectory)
            if ids is not None:
                held = trajectory.ids
                if ids[: len(held)] == held and (len(ids) > len(held) or ended):
                    return Context(ids, text, trajectory, ids[len(held) :], len(trajectory.token_ids))
                if ended and ids[: len(held) - 1] == held[:-1]:
                    inserted = ids[len(held) - 1 :]
                    return Context(held + inserted, text, trajectory, inserted, len(trajectory.token_ids))
                continue
            if text.startswith(trajectory.text) and (len(text) > len(trajectory.text) or ended):
                return self._continuing(trajectory, text, len(trajectory.text))
            if ended:
                body = len(trajectory.text) - len(self.tokenizer.convert_ids_to_tokens(trajectory.token_ids[-1]))
                if text.startswith(trajectory.text[:body]):
                    return self._continuing(trajectory, text, body)
        return Context(ids if ids is not None else self.tokenize(text), text, None, [], 0)

    def added_messages(self, messages: list[dict]) -> list[Observation]:
        """The messages after the last assistant message of a chat call's ``messages``, when that message is a
        reply of this session (else none: the calls it holds were not the model's); a tool message comes with
        the call of that reply it answers."""
        last = max((index for index, message in enumerate(messages) if message["role"] == "assistant"), default=None)
        if last is None:
            return []
        reply, where = messages[last], f"messages[{last}]"
        calls = message_calls(reply, where)
        if reply_key(content_text(reply.get("content"), where), calls) not in self.raw_replies:
            return []
        by_id = {listed.get("id"): call for listed, call in zip(reply.get("tool_calls") or [], calls)}
        return [
            Observation(
                message["role"],
                content_text(message.get("content"), f"messages[{index}]"),
                by_id.get(message.get("tool_call_id")) if message["role"] == "tool" else None,
            )
            for index, message in enumerate(messages[last + 1 :], last + 1)
        ]

    def _continuing(self, trajectory: SessionTrajectory, text: str, held: int) -> Context:
        """The context of a prompt ``text`` whose first ``held`` characters are ``trajectory``'s."""
        inserted = self.tokenize(text[held:])
        return Context(trajectory.ids + inserted, text, trajectory, inserted, len(trajectory.token_ids))

    def _ended_on_eos(self, trajectory: SessionTrajectory) -> bool:
        """The trajectory's last reply sampled something, then EOS: a prompt may hold that reply without it."""
        tokens, turns = trajectory.token_ids, trajectory.turn_of_token
        return len(tokens) >= 2 and tokens[-1] in self.eos_ids and turns[-2] == turns[-1] == trajectory.turns - 1

    def record(self, context: Context, outputs: list[TurnOutput]) -> list[SessionTrajectory]:
        """Add a call's replies: the first extends the context's trajectory (if it is still where the call
        found it), the others (``n`` > 1) start trajectories of their own from the same context. A forced tool
        call's opening is inserted (loss mask 0) after the prompt of a new trajectory too."""
        self.calls += 1
        recorded = []
        for index, output in enumerate(outputs):
            trajectory = context.trajectory
            if index > 0 or trajectory is None or len(trajectory.token_ids) != context.length:
                trajectory = SessionTrajectory(context.ids[: len(context.ids) - len(context.opening)], context.text)
                trajectory.insert(context.opening)
                self.trajectories.append(trajectory)
            else:
                if context.observations:
                    trajectory.observations[trajectory.turns - 1] = list(context.observations)
                trajectory.insert(context.inserted)
                trajectory.text = context.text
            trajectory.add_reply(output, self.raw_text(output.token_ids))
            recorded.append(trajectory)
        self.last = recorded[0] if recorded else self.last
        return recorded

    def remember_reply(self, key: tuple, token_ids: list[int], opening: str = "") -> None:
        """The reply returned as ``key`` renders, when sent back, as the text of its sampled ids (after the
        ``opening`` of a forced tool call, inserted before them)."""
        ended = bool(token_ids) and token_ids[-1] in self.eos_ids
        self.raw_replies[key] = opening + self.raw_text(token_ids[:-1] if ended else token_ids)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class Sessions:
    """The open sessions of an endpoint, found by their keys; and the keys of the latest closed ones, so that a
    call with a key whose episode has ended is told so."""

    def __init__(self, tokenizer, *, eos_ids: list[int], max_sessions: int = 4096):
        """``max_sessions``: open sessions at most, and closed keys remembered at most."""
        self.tokenizer, self.eos_ids, self.max_sessions = tokenizer, eos_ids, max_sessions
        self._open: dict[bytes, Session] = {}  # by the digest of the key
        self._closed: OrderedDict[bytes, None] = OrderedDict()  # digests of closed sessions' keys, oldest first

    def open(self, order: int = 0) -> Session:
        if len(self._open) >= self.max_sessions:
            raise RuntimeError(f"{self.max_sessions} sessions are open; close finished ones")
        session = Session(secrets.token_hex(12), self.tokenizer, eos_ids=self.eos_ids, order=order)
        self._open[_digest(session.key)] = session
        return session

    def by_key(self, key: str) -> Session | None:
        """The open session whose key is ``key``; None if there is none."""
        return self._open.get(_digest(key))

    def ended(self, key: str) -> bool:
        """``key`` was the key of a session closed since (one of the latest ``max_sessions`` closed)."""
        return _digest(key) in self._closed

    def close(self, session: Session) -> list[SessionTrajectory]:
        """Stop serving the session; its trajectories."""
        session.closed = True
        digest = _digest(session.key)
        if self._open.pop(digest, None) is not None:
            self._closed[digest] = None
            if len(self._closed) > self.max_sessions:
                self._closed.popitem(last=False)
        return session.trajectories

    def __len__(self) -> int:
        return len(self._open)
