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

import contextlib
import datetime
import functools
import os
import pickle
import socket
import warnings
from collections.abc import Callable

import torch
from torch import nn

from unipg.learn.precision import Float32Masters

IMPLEMENTATION_FLAGS = ("fused", "foreach", "capturable", "differentiable")  # of a torch optimizer's groups
SHARD_INDEX = ".metadata"  # the index of a save_sharded folder: which file holds which shard of which tensor
# Besides DCP's metadata classes, what a shard index may name: a tensor's size, layout and dtype, and its path.
_INDEX_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
}


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


def init_group(
    rank: int, world_size: int, host: str, port: int, *, device: str = "cpu", timeout: float | None = None
) -> None:
    """Join the process group of ``world_size`` ranks whose rank 0 listens at ``host:port``, with the backend
    ``group_backend(device)``. ``timeout``: seconds a rank waits for its peers in the rendezvous and in each
    collective before it fails (gloo raises; NCCL's watchdog ends the process); None: torch's default."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", host)
    backend = group_backend(device)
    address = f"[{host}]" if ":" in host else host
    dist.init_process_group(
        backend,
        init_method=f"tcp://{address}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout) if timeout is not None else None,
    )


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


def _shard_options():
    """Sharded state dicts (each rank's DTensor shards, never gathered) of the trainable weights; strict=False
    because the frozen weights (left out) are not loaded back."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=False, ignore_frozen_params=True, strict=False)


class _IndexUnpickler(pickle.Unpickler):
    """Reads a shard index, which DCP writes as a pickle, allowing only the classes such an index holds, so that a
    crafted checkpoint cannot run code as it loads."""

    def find_class(self, module: str, name: str):
        found = super().find_class(module, name) if self._allowed(module, name) else None
        if found is None:
            raise pickle.UnpicklingError(
                f"a shard index names {module}.{name}, which no index written by torch.distributed.checkpoint holds"
            )
        return found

    @staticmethod
    def _allowed(module: str, name: str) -> bool:
        if module == "torch":
            return name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
        return module == "torch.distributed.checkpoint.metadata" or (module, name) in _INDEX_GLOBALS


def read_shard_index(directory: str | os.PathLike):
    """The index of a ``save_sharded`` folder (a ``torch.distributed.checkpoint`` ``Metadata``): by flattened name
    (``model.<weight>``, ``optimizer.state.<weight>.exp_avg``, ``masters.<weight>``) each tensor's size and dtype,
    and which rank's file holds which of its chunks."""
    with open(os.path.join(directory, SHARD_INDEX), "rb") as file:
        return _IndexUnpickler(file).load()


def read_shards(state: dict, directory: str | os.PathLike) -> None:
    """Load a ``save_sharded`` folder into ``state`` (a state dict of this rank's tensors, or whole ones in one
    process) with ``dcp.load``, in place, without running code a crafted folder holds: the index is read with
    ``read_shard_index``, the tensors with ``torch.load(weights_only=True)`` (as DCP does), and the other values
    (the optimizer's hyperparameters) are checked to load with ``weights_only=True`` before DCP loads them."""
    import torch.distributed.checkpoint as dcp

    reader_class, planner_class = _safe_loading_classes()
    with warnings.catch_warnings(), _plain_failures(f"loading the shards in {directory}"):
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # as no_dist asks
        dcp.load(state, storage_reader=reader_class(directory), planner=planner_class(), no_dist=process_rank()[1] == 1)


@contextlib.contextmanager
def _plain_failures(doing: str):
    """DCP's ``CheckpointException``, a ``BaseException`` that escapes ``except Exception``, as a ``RuntimeError``
    naming what failed and why on the first rank that failed."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as error:
        rank, (failure, _) = next(iter(error.failures.items()))
        reason = str(failure).strip().splitlines() or [""]
        raise RuntimeError(f"{doing} failed on rank {rank}: {type(failure).__name__}: {reason[0]}") from None


@functools.cache
def _safe_loading_classes() -> tuple[type, type]:
    """A ``FileSystemReader`` that reads the index with ``read_shard_index``, and a ``DefaultLoadPlanner`` whose
    non-tensor values must load with ``weights_only=True`` (DCP's own loads them with ``weights_only=False``)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class ShardReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = read_shard_index(self.path)
            metadata.storage_meta = metadata.storage_meta or StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class ShardLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            try:
                torch.load(value, weights_only=True)
            except pickle.UnpicklingError as error:
                found = [line for line in str(error).splitlines() if "GLOBAL" in line] or [""]
                raise pickle.UnpicklingError(
                    f"the shards' value {read_item.dest_index.fqn} is not plain data ({found[0].strip()})"
                ) from None
            value.seek(0)
            super().load_bytes(read_item, value)

    return ShardReader, ShardLoadPlanner


def _optimized_view(model: nn.Module, masters: Float32Masters) -> nn.Module:
    """A module whose parameters are what the optimizer steps, under the names of the ``model``'s parameters
    they stand for: each low-precision one's float32 master, the others themselves. ``get_optimizer_state_dict``
    names an optimizer's state by the parameters of the module it is given, and the masters are no parameters of
    ``model``."""
    view = nn.Module()
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        *path, leaf = name.split(".")
        owner = view
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, masters.optimized([parameter])[0])
    return view


def keep_implementation(saved_groups: list[dict], optimizer: torch.optim.Optimizer) -> None:
    """Set the implementation flags of each saved parameter group to those of ``optimizer``'s group: they say how
    the optimizer runs here, not what it computes, and a checkpoint from another number of ranks carries flags
    that do not fit (one process steps with the fused AdamW, the ranks, over sharded parameters, without it)."""
    for saved, own in zip(saved_groups, optimizer.param_groups, strict=True):
        saved.update({flag: own[flag] for flag in IMPLEMENTATION_FLAGS if flag in own})


def frozen_parameter_names(model: nn.Module) -> set[str]:
    """The names of ``model``'s frozen parameters, each name of a tied one included: what a sharded checkpoint
    leaves out."""
    return {name for name, parameter in model.named_parameters(remove_duplicate=False) if not parameter.requires_grad}


def _masters_by_name(model: nn.Module, masters: Float32Masters) -> dict[str, tuple[nn.Parameter, nn.Parameter]]:
    """(weight, its float32 master) of each low-precision trainable weight of ``model``, by the weight's name."""
    pairs = {}
    for name, parameter in model.named_parameters():
        master = masters.optimized([parameter])[0]
        if master is not parameter:
            pairs[name] = (parameter, master)
    return pairs


def _sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, masters: Float32Masters) -> dict:
    """What ``save_sharded`` writes, each tensor this rank's shard (a DTensor) or, in one process, the tensor:
    ``model`` (the trainable weights and the buffers), ``optimizer`` (its state by parameter name) and ``masters``
    (the float32 masters of low-precision weights, by the name of their weight; views of the masters, so that a
    load writes into them)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    weights = get_model_state_dict(model, options=_shard_options())
    for name in frozen_parameter_names(model):  # the tied twin of a frozen weight outlives ignore_frozen_params
        weights.pop(name, None)
    return {
        "model": weights,
        "optimizer": get_optimizer_state_dict(_optimized_view(model, masters), optimizer, options=_shard_options()),
        "masters": {name: master.detach() for name, (_, master) in _masters_by_name(model, masters).items()},
    }


def save_sharded(
    directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, masters: Float32Masters
) -> None:
    """Every rank writes its shards of ``model``'s trainable weights, of the ``optimizer``'s state and of the float32
    ``masters`` into ``directory`` with ``torch.distributed.checkpoint``, fsynced (collective: all ranks call); no
    rank gathers a whole tensor. Frozen weights (a reference model, a LoRA adapter's base) are left out: they are
    the configured model. The folder loads back with any number of processes (``load_sharded``), one included."""
    import torch.distributed.checkpoint as dcp

    state = _sharded_state(model, optimizer, masters)
    writer = dcp.FileSystemWriter(directory, sync_files=True)
    with warnings.catch_warnings(), _plain_failures(f"writing shards into {directory}"):
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # as no_dist asks
        dcp.save(state, storage_writer=writer, no_dist=process_rank()[1] == 1)


def load_sharded(
    directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, masters: Float32Masters
) -> None:
    """Load a ``save_sharded`` folder into ``model``, ``optimizer`` and ``masters``, each rank reading its own shards
    whatever the number of ranks that wrote them (collective: all ranks call). A folder without masters (written
    from float32 weights) starts them from the loaded weights."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = _sharded_state(model, optimizer, masters)
    saved = read_shard_index(directory).state_dict_metadata
    state["masters"] = {name: master for name, master in state["masters"].items() if f"masters.{name}" in saved}
    read_shards(state, directory)  # the masters load in place
    set_model_state_dict(model, state["model"], options=_shard_options())
    keep_implementation(state["optimizer"]["param_groups"], optimizer)
    set_optimizer_state_dict(_optimized_view(model, masters), optimizer, state["optimizer"], options=_shard_options())
    with torch.no_grad():
        for name, (weight, master) in _masters_by_name(model, masters).items():
            if name not in state["masters"]:
                master.copy_(weight.float())
