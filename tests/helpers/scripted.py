"""A policy that writes given turns: drives the agent loop where a test needs exact turns (a tool call in a
model's format), which the embedded model, untrained, would not write."""

import contextlib

from unipg.inference import TurnOutput


class ScriptedEngine:
    """The ``HFService`` interface the agent loop uses, answering each episode's turns from a script.

    Each turn is tokenised as it is and, unless it ends with a stop string (``keep_stop``), followed by the
    EOS token, as a model that stops at EOS writes it; ``text`` is the turn without special tokens."""

    def __init__(self, tokenizer, turns: list[str], *, keep_stop: tuple[str, ...] = ()):
        self.tokenizer, self.turns, self.keep_stop = tokenizer, list(turns), keep_stop
        self.contexts: list[list[int]] = []  # the context of every generate call, in order

    @contextlib.asynccontextmanager
    async def running(self):
        yield self

    @contextlib.asynccontextmanager
    async def episode(self):
        yield

    async def generate(self, context_ids, *, max_new_tokens, order=0) -> TurnOutput:
        self.contexts.append(list(context_ids))
        text = self.turns.pop(0)
        stopped = text.endswith(self.keep_stop) if self.keep_stop else False
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not stopped:
            ids = ids + [self.tokenizer.eos_token_id]
        visible = self.tokenizer.decode(ids, skip_special_tokens=True)
        return TurnOutput(ids, [-1.0] * len(ids), visible, "stop", not stopped, 0)
