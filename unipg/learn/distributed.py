"""Sharding a learner's model over several local processes with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each process (rank) holds 1/N of every parameter, of its gradient and of the optimizer's state; a forward
pass all-gathers one decoder layer at a time and the backward pass reduce-scatters the gradients. The process
group is gloo on CPU; on GPU it is NCCL for CUDA tensors and gloo for CPU ones (the metrics the ranks add up);
its rendezvous is a TCP address of rank 0 (the loopback address for local processes, rank 0's node for Ray
actors).

Here: the building blocks — starting the process group, sharding a Hugging Face causal LM layer by
layer, the bytes a rank holds, and the full weights gathered for an inference engine.
"""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Callable

import torch
from torch import nn


def process_rank() -> tuple[int, int]:
    """(rank, world size) of this process in the default process group; (0, 1) when there is none."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def sum_across_ranks(values: dict[str, float]) -> dict[str, float]:
    """Each value summed over the ranks (every rank passes the same keys)."""
    import torch.distributed as dist

    names = sorted(values)
    total = torch.tensor([values[name] for name in names], dtype=torch.float64)
    dist.all_reduce(total)
    return dict(zip(names, total.tolist()))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (for the process group's rendezvous)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def group_backend(device: str) -> str:
    """The process group's backend for ranks on ``device``: gloo on CPU; on CUDA, NCCL for CUDA tensors and gloo
    for CPU ones, since ``sum_across_ranks`` adds up CPU tensors, which an NCCL-only group refuses."""
    return "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"


def init_group(rank: int, world_size: int, host: str, port: int, *, device: str = "cpu") -> None:
    """Join the process group of ``world_size`` ranks whose rank 0 listens at ``host:port``, with the backend
    ``group_backend(device)``."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", host)
    backend = group_backend(device)
    address = f"[{host}]" if ":" in host else host
    dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world_size)


def init_local_group(rank: int, world_size: int, port: int, *, device: str = "cpu") -> None:
    """Join the process group of ``world_size`` processes on this machine, rendezvous on the loopback address."""
    init_group(rank, world_size, "127.0.0.1", port, device=device)


def spawn_local(function: Callable, world_size: int, *args) -> None:
    """Run ``function(rank, world_size, port, *args)`` in ``world_size`` fresh processes and wait for all."""
    import torch.multiprocessing as mp

    mp.start_processes(
        function, args=(world_size, free_port(), *args), nprocs=world_size, join=True, start_method="spawn"
    )


def shard_model(model: nn.Module) -> nn.Module:
    """Apply ``fully_shard`` to every decoder layer (the repeated blocks of a Hugging Face model), then to the
    whole model for what is left (embeddings, final norm, lm_head); returns the model, sharded in place.

    FSDP2 wants one dtype among the trainable parameters of a group: where what is left mixes dtypes (a
    bfloat16 critic's backbone and its float32 value head), each float32 child is a group of its own."""
    from torch.distributed.fsdp import fully_shard

    layers = [module for module in model.modules() if type(module).__name__.endswith(("DecoderLayer", "Block"))]
    for layer in layers:
        fully_shard(layer)
    for child in _float32_children(model, layers):
        fully_shard(child)
    fully_shard(model)
    return model


def _float32_children(model: nn.Module, layers: list[nn.Module]) -> list[nn.Module]:
    """The children of ``model`` whose trainable parameters outside ``layers`` are all float32, where the rest
    of the model's such parameters are of another dtype; none where they are of one dtype."""
    in_layers = {id(p) for layer in layers for p in layer.parameters()}

    def trainable_dtypes(module: nn.Module) -> set[torch.dtype]:
        return {p.dtype for p in module.parameters() if p.requires_grad and id(p) not in in_layers}

    if len(trainable_dtypes(model)) < 2:
        return []
    return [child for child in model.children() if trainable_dtypes(child) == {torch.float32}]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded, DTensor) tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def resident_bytes(parameters: list[nn.Parameter], optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes this rank holds for ``parameters``, their gradients and the optimizer's state of them."""
    tensors = [local_tensor(p) for p in parameters]
    tensors += [local_tensor(p.grad) for p in parameters if p.grad is not None]
    if optimizer is not None:
        tensors += [
            local_tensor(value)
            for state in optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        ]
    return sum(t.numel() * t.element_size() for t in tensors)


def full_state_dict(model: nn.Module, *, trained_only: bool = False) -> dict[str, torch.Tensor]:
    """Every rank gathers the full (unsharded) weights on CPU, e.g. once per version for an inference engine;
    with ``trained_only``, frozen parameters (a reference model, a LoRA adapter's base) are left out before the
    gather, so they cost no communication."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trained_only)
    return get_model_state_dict(model, options=options)


def save_sharded(directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank writes its shards of the model and optimizer state with ``torch.distributed.checkpoint``;
    the folder loads back with any number of processes (``load_sharded``), one included."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save(
        {"model": model_state, "optimizer": optimizer_state},
        checkpoint_id=str(directory),
        no_dist=process_rank()[1] == 1,
    )


def load_sharded(directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a ``save_sharded`` folder into ``model`` and ``optimizer``, sharded over this process group or not."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    with warnings.catch_warnings():  # loading in one process is what no_dist asks for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(directory), no_dist=process_rank()[1] == 1)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
