"""A sharded checkpoint (``unipg.checkpoint.files``, format version 2) read in one process: the shapes of its
weights, read from its index alone, and every tensor whole, e.g. to turn it into one safetensors file::

    from safetensors.torch import save_file
    from unipg.checkpoint.shards import consolidated_tensors

    save_file(consolidated_tensors("runs/<run>/checkpoints/step-00000120"), "step-00000120.safetensors")

Its tensors are named as the ranks saved them: ``model.<weight>`` (the policy's trainable weights and buffers,
by their names in ``LMPolicy``: ``model.…``, ``value_head.…``, ``critic.…``), ``optimizer.state.<weight>.<key>``
(AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``) and ``masters.<weight>`` (float32 masters of low-precision
weights).
"""

from __future__ import annotations

from pathlib import Path

import torch

from unipg.learn.distributed import read_shard_index, read_shards

WEIGHTS_PREFIX = "model."  # the policy's weights among a sharded checkpoint's tensors


def _tensor_entries(path: Path) -> dict:
    """The index's entries of tensors (the optimizer's hyperparameters, stored as bytes, left out)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    index = read_shard_index(path).state_dict_metadata
    return {name: entry for name, entry in index.items() if isinstance(entry, TensorStorageMetadata)}


def weight_shapes(path: str | Path) -> dict[str, torch.Tensor]:
    """The policy's weights a sharded checkpoint holds, by their names in the policy, as tensors on the meta
    device (a shape and a dtype, no data): what ``tensor_mismatch`` compares with the policy's state dict."""
    return {
        name.removeprefix(WEIGHTS_PREFIX): torch.empty(entry.size, dtype=entry.properties.dtype, device="meta")
        for name, entry in _tensor_entries(Path(path)).items()
        if name.startswith(WEIGHTS_PREFIX)
    }


def consolidated_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint, whole and on the CPU, by its name (see the module's docstring),
    whatever the number of ranks that wrote it. Checksums are not verified here: ``load_checkpoint`` does."""
    path = Path(path)
    tensors = {
        name: torch.empty(entry.size, dtype=entry.properties.dtype) for name, entry in _tensor_entries(path).items()
    }
    read_shards(tensors, path)
    return tensors
