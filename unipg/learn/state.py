"""A run's state beyond its weights, in the forms a checkpoint stores: the random generators as JSON, an
optimizer's state as a tensor group plus JSON.

``optimizer_tensors``/``load_optimizer`` flatten an optimizer's ``state_dict`` into tensors plus JSON, and
``rng_state``/``restore_rng`` (``generator_state``/``restore_generator`` for one ``torch.Generator``) encode
the random generators as JSON, so that a run resumed from a ``unipg.checkpoint.store`` checkpoint continues
bit for bit like an uninterrupted one.
"""

from __future__ import annotations

import base64
import random
import warnings

import numpy as np
import torch

# --- random generators as JSON -----------------------------------------------------------------------


def _encode_bytes(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode("ascii")


def _decode_bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def generator_state(generator: torch.Generator) -> str:
    """A ``torch.Generator``'s state (a uint8 tensor) as a base64 string for the JSON state."""
    return _encode_bytes(generator.get_state())


def restore_generator(generator: torch.Generator, state: str) -> torch.Generator:
    """Set ``generator`` back to a state from ``generator_state``; returns it."""
    generator.set_state(_decode_bytes(state))
    return generator


def rng_state() -> dict:
    """The global Python, NumPy, torch CPU and (if present) CUDA generator states, as JSON-ready values."""
    version, internal, gauss_next = random.getstate()
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "kind": kind,
            "keys": keys.tolist(),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": _encode_bytes(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [_encode_bytes(device_state) for device_state in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict) -> None:
    """Set the global generators back to a state from ``rng_state``."""
    python = state["python"]
    random.setstate((python["version"], tuple(python["internal"]), python["gauss_next"]))
    numpy = state["numpy"]
    np.random.set_state(
        (
            numpy["kind"],
            np.asarray(numpy["keys"], dtype=np.uint32),
            numpy["position"],
            numpy["has_gauss"],
            numpy["cached_gaussian"],
        )
    )
    torch.set_rng_state(_decode_bytes(state["torch"]))
    saved_cuda = state.get("cuda", [])
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if len(saved_cuda) != available:
        warnings.warn(
            f"the checkpoint holds RNG states of {len(saved_cuda)} CUDA devices and this machine has "
            f"{available}; restoring the first {min(len(saved_cuda), available)}",
            RuntimeWarning,
        )
    for device, device_state in enumerate(saved_cuda[:available]):
        torch.cuda.set_rng_state(_decode_bytes(device_state), device=device)


# --- optimizer state ---------------------------------------------------------------------------------


def _to_json(value, where: str):
    """A JSON-ready copy of an optimizer value; tuples (AdamW's betas) are tagged so they come back as tuples."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [_to_json(item, where) for item in value]}
    if isinstance(value, list):
        return [_to_json(item, where) for item in value]
    raise TypeError(
        f"optimizer value {where} is a {type(value).__name__}; a checkpoint stores only tensors, "
        "numbers, strings, None and lists or tuples of them"
    )


def _from_json(value):
    if isinstance(value, dict) and "__tuple__" in value:
        return tuple(_from_json(item) for item in value["__tuple__"])
    if isinstance(value, list):
        return [_from_json(item) for item in value]
    return value


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """``optimizer.state_dict()`` as a flat tensor group plus JSON metadata, for ``CheckpointStore.save``.

    Per-parameter state tensors are named ``state.{param_index}.{key}`` (``state.3.exp_avg``); a tensor
    hyperparameter is ``param_groups.{group_index}.{key}``. Everything else (a float ``step``, the groups'
    hyperparameters and parameter indices) goes into the metadata.
    """
    state_dict = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    per_param: dict[str, dict] = {}
    for index, param_state in state_dict["state"].items():
        per_param[str(index)] = {}
        for key, value in param_state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{key}"] = value
            else:
                per_param[str(index)][key] = _to_json(value, f"state[{index}][{key!r}]")
    groups = []
    for group_index, group in enumerate(state_dict["param_groups"]):
        groups.append({})
        for key, value in group.items():
            if isinstance(value, torch.Tensor):
                tensors[f"param_groups.{group_index}.{key}"] = value
            else:
                groups[-1][key] = _to_json(value, f"param_groups[{group_index}][{key!r}]")
    return tensors, {"state": per_param, "param_groups": groups}


def load_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Restore ``optimizer`` from the output of ``optimizer_tensors`` (hyperparameters included)."""
    state = {
        int(index): {key: _from_json(value) for key, value in values.items()} for index, values in meta["state"].items()
    }
    groups = [{key: _from_json(value) for key, value in group.items()} for group in meta["param_groups"]]
    for name, tensor in tensors.items():
        section, index, key = name.split(".", 2)
        if section == "state":
            state.setdefault(int(index), {})[key] = tensor
        elif section == "param_groups":
            groups[int(index)][key] = tensor
        else:
            raise ValueError(
                f"optimizer tensor {name!r} is neither 'state.<param>.<key>' nor "
                "'param_groups.<group>.<key>'; was it written by optimizer_tensors()?"
            )
    optimizer.load_state_dict({"state": state, "param_groups": groups})
