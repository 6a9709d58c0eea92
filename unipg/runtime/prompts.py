"""The order in which an lm run draws its training prompts, kept exactly across resumes."""

from __future__ import annotations

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
            }

    def load_state(self, state: dict) -> None:
        """Continue from a position given by ``state``: its pending prompts are drawn first."""
        with self._lock:
            self._order, self._pending = list(state["order"]), []
            self._replay = [int(index) for index in state.get("pending", [])]
            restore_generator(self.generator, state["generator"])
