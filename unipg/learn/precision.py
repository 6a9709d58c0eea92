"""Low-precision parameters with a float32 optimizer: the model computes in bfloat16 (or float16), the
optimizer steps float32 master copies and keeps its state (Adam's moments) in float32.

Adam's update of a bfloat16 weight is often below the weight's resolution (8 bits of mantissa): stepping the
bfloat16 weights directly loses most small updates, and bfloat16 moment estimates lose more. So each
low-precision trainable parameter gets a float32 master; after the backward pass its gradient is moved to
the master (as float32), the optimizer steps the masters, and the model's weights are set to the masters
rounded to their dtype. Memory per such parameter: 2 (weight) + 2 (gradient, freed once moved) + 4 (master)
+ 8 (AdamW state) bytes. Float32 parameters are stepped as they are.
"""

from __future__ import annotations

import torch
from torch import nn

MASTER_KEY = "float32_master"  # the master's value, kept in the optimizer's state only inside a checkpoint


class Float32Masters:
    """float32 masters of the low-precision parameters among ``parameters``."""

    def __init__(self, parameters: list[nn.Parameter]):
        self.pairs = [(p, nn.Parameter(p.detach().float().clone())) for p in parameters if p.dtype != torch.float32]
        self._master_of = {id(model): master for model, master in self.pairs}

    def optimized(self, parameters: list[nn.Parameter]) -> list[nn.Parameter]:
        """What the optimizer steps in place of ``parameters``: each low-precision one's master."""
        return [self._master_of.get(id(p), p) for p in parameters]

    def move_gradients(self) -> None:
        """Each low-precision gradient, as float32, onto its master; the low-precision one is freed."""
        for model, master in self.pairs:
            master.grad = None if model.grad is None else model.grad.float()
            model.grad = None

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """The model's weights set to the masters, rounded to the weights' dtype."""
        for model, master in self.pairs:
            model.copy_(master)

    def stash(self, optimizer: torch.optim.Optimizer) -> None:
        """Put each master's value into the optimizer's state, so that a checkpoint of the optimizer keeps it."""
        for _, master in self.pairs:
            optimizer.state[master][MASTER_KEY] = master.detach()

    def discard(self, optimizer: torch.optim.Optimizer) -> None:
        """Take the values ``stash`` put into the optimizer's state out again (the masters themselves hold them)."""
        for _, master in self.pairs:
            optimizer.state[master].pop(MASTER_KEY, None)

    @torch.no_grad()
    def unstash(self, optimizer: torch.optim.Optimizer) -> None:
        """Take the masters' values back out of the optimizer's state (after ``stash`` or a restore); a state
        without them (a checkpoint of float32 weights) starts the masters from the model's weights."""
        for model, master in self.pairs:
            saved = optimizer.state.get(master, {}).pop(MASTER_KEY, None)
            master.copy_(saved if saved is not None else model.float())
