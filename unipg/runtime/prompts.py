"""The order in which an lm run draws its training prompts, kept exactly across resumes."""

from __future__ import annotations

import hashlib
import threading

import torch

from unipg.learn.state import generator_state, restore_generator
from unipg.tasks.base import Example


class PromptSampler:
    """Draws training examples without replacement, reshuffling after every pass over the split. It keeps the
    prompts drawn but not yet trained on (until ``settle``), saved with its position under one lock: a resumed
    run draws exactly those again first, in order, then goes on where the interrupted run stopped."""

    def __init__(self, examples: list[Example], seed: int):
        if not examples:
            raise ValueError("the task's training split is empty; give the task some training examples")
        self.examples, self.generator = examples, torch.Generator().manual_seed(seed)
        self._order: list[int] = []
        self._pending: list[int] = []  # indices drawn, not yet settled, in draw order
        self._replay: list[int] = []  # a checkpoint's pending indices, not yet drawn again
        self._lock = threading.Lock()  # the rollout thread draws while the learner's thread saves and settles

    def next(self, count: int) -> list[Example]:
        with self._lock:
            chosen = self._replay[:count]
            del self._replay[:count]
            while len(chosen) < count:
                if not self._order:
                    self._order = torch.randperm(len(self.examples), generator=self.generator).tolist()
                chosen.append(self._order.pop())
            self._pending += chosen
        return [self.examples[index] for index in chosen]

    def settle(self, groups: list) -> None:
        """``groups`` (of trajectories) will not be trained on later: taken by the learner, or dropped."""
        with self._lock:
            for group in groups:
                example = group.items[0].example
                same = [i for i in self._pending if self.examples[i] is example or self.examples[i] == example]
                if same:  # (a group of before a rollback is no longer pending)
                    self._pending.remove(same[0])

    def state(self) -> dict:
        """The position in the current pass, the shuffling generator and the pending prompts, as JSON."""
        with self._lock:
            return {
                "order": list(self._order),
                "generator": generator_state(self.generator),
                "pending": self._pending + self._replay,
                "split": self.split_fingerprint(),
            }

    def split_fingerprint(self) -> str:
        """A digest of the training split's prompts and answers, in order: the positions a state holds are indices
        into this very list."""
        digest = hashlib.sha1()
        for example in self.examples:
            digest.update(repr((example.prompt, example.answer)).encode())
        return f"{len(self.examples)}:{digest.hexdigest()[:16]}"

    def check_state(self, state: dict) -> None:
        """A ValueError, saying what changed and what to do, when ``state`` was saved over another training split
        (the task's name, options or data changed since): its indices would pick other prompts, or none."""
        saved = state.get("split") if isinstance(state, dict) else None
        indices = [*state.get("order", []), *state.get("pending", [])] if isinstance(state, dict) else []
        if saved is None:  # a checkpoint written before the digest was kept: the indices must at least fit
            fits = all(isinstance(index, int) and 0 <= index < len(self.examples) for index in indices)
            saved = None if fits else f"more than {len(self.examples)}"
        elif saved == self.split_fingerprint():
            saved = None
        if saved is not None:
            raise ValueError(
                f"the checkpoint was saved over another training split ({saved.partition(':')[0]} examples) than "
                f"the configured task's ({len(self.examples)} examples): task.name, task.options or the task's data "
                "changed since. Resume with the run's own task settings (drop the task.* overrides), or train on "
                "the other task in a new run (unipg train task.name=... model.name=<run>/policy once the run has "
                "finished)"
            )

    def load_state(self, state: dict) -> None:
        """Continue from a position given by ``state``: its pending prompts are drawn first."""
        with self._lock:
            self._order, self._pending = list(state["order"]), []
            self._replay = [int(index) for index in state.get("pending", [])]
            restore_generator(self.generator, state["generator"])
