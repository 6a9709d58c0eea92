"""Peak tensor memory on the CPU, measured deterministically: torch's CPU allocator keeps no statistics, so a
dispatch mode records every storage an operator creates and when the last tensor on it is freed."""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakTensorBytes(TorchDispatchMode):
    """While on, ``peak`` is the most bytes of operator-created storages alive at once, forward and backward
    (autograd runs a CPU backward on the calling thread, under the mode); ``live`` what is alive now. Tensors
    that existed before (parameters, inputs) are not counted, their gradients are.

    A storage counts from the first operator output on it until the last tensor on it (views included) is
    freed; a tensor autograd saves for the backward pass stays alive with it."""

    def __init__(self):
        super().__init__()
        self.tensors_on: dict[int, int] = {}  # storage address → tracked tensors on it
        self.bytes_of: dict[int, int] = {}  # storage address → its bytes
        self.tracked: set[int] = set()  # ids of the tracked tensors alive
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and id(value) not in self.tracked:
                self._track(value)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return
        address = storage.data_ptr()
        if address not in self.tensors_on:
            self.tensors_on[address], self.bytes_of[address] = 0, storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.tensors_on[address] += 1
        self.tracked.add(id(tensor))
        weakref.finalize(tensor, self._release, address, id(tensor))

    def _release(self, address: int, tensor_id: int) -> None:
        self.tracked.discard(tensor_id)
        self.tensors_on[address] -= 1
        if self.tensors_on[address] == 0:
            del self.tensors_on[address]
            self.live -= self.bytes_of.pop(address)
