"""LoRA adapters: what of a LoRA-wrapped policy is saved and synced, in the PEFT format.

With ``model.lora_rank > 0`` only the adapter is trained; the base weights are the frozen initial model. So a
checkpoint stores only the adapter, as PEFT writes it (``adapter_config.json`` and ``adapter_model.safetensors``,
loadable with ``PeftModel.from_pretrained(base, folder)``), and the weight sync to an inference copy sends
only the adapter's tensors. A model without adapters is saved and synced whole.

With ``agent.role_policy: adapters`` the model holds one adapter per role of a multi-role task, named after the
role (PEFT's named adapters on one base model). A pass runs with one role's adapter active (``role_adapter``);
the others take no part in it, so they get no gradient. Checkpoints and weight syncs carry every role's adapter.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

ADAPTER_WEIGHTS = "adapter_model"  # PEFT's file stem: adapter_model.safetensors
ADAPTER_CONFIG = "adapter_config.json"


def has_adapter(model: nn.Module) -> bool:
    """Whether ``model`` is a PEFT model (LoRA-wrapped)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def role_adapter_names(model: nn.Module) -> list[str]:
    """The roles that have an adapter of their own (``agent.role_policy: adapters``), in the order they were added;
    empty for a model without adapters or with PEFT's one unnamed (``default``) adapter."""
    names = list(getattr(model, "peft_config", {})) if has_adapter(model) else []
    return [] if names == ["default"] else names


def role_adapter_parameters(model: nn.Module, role: str) -> list[nn.Parameter]:
    """The parameters of ``role``'s adapter (PEFT names them ``...lora_A.<role>.weight``)."""
    pattern = re.compile(rf"\.lora_\w+\.{re.escape(role)}(\.|$)")
    return [parameter for name, parameter in model.named_parameters() if pattern.search(name)]


@contextmanager
def role_adapter(model: nn.Module, role: str | None):
    """Run the block with ``role``'s adapter active (None: the model as it is). Every adapter stays trainable:
    PEFT's ``set_adapter`` (and the end of ``disable_adapter``) leave only the active one requiring grad, and the
    learner steps them all."""
    if role is None:
        yield
        return
    model.set_adapter(role)
    for name, parameter in model.named_parameters():
        if "lora_" in name:
            parameter.requires_grad_(True)
    yield


def save_adapter(model: nn.Module, directory: str | Path) -> Path:
    """Write the adapter of a PEFT ``model`` in the PEFT format into ``directory``; returns the folder."""
    if not has_adapter(model):
        raise ValueError("save_adapter needs a LoRA-wrapped model (model.lora_rank > 0)")
    directory = Path(directory)
    model.save_pretrained(directory)
    return directory


def adapter_tensors(model: nn.Module, name: str = "default") -> dict[str, torch.Tensor]:
    """The tensors of adapter ``name`` (a role's, or PEFT's one ``default``) under PEFT's names (those of
    ``adapter_model.safetensors``)."""
    from peft import get_peft_model_state_dict

    return {key: tensor.detach() for key, tensor in get_peft_model_state_dict(model, adapter_name=name).items()}


def load_adapter_tensors(model: nn.Module, tensors: dict[str, torch.Tensor], name: str = "default") -> None:
    """Load ``adapter_tensors`` of adapter ``name`` back; a ValueError names a tensor the adapter does not have or
    lacks."""
    from peft import set_peft_model_state_dict

    expected = adapter_tensors(model, name)
    missing, unexpected = expected.keys() - tensors.keys(), tensors.keys() - expected.keys()
    if missing or unexpected:
        raise ValueError(
            f"the adapter does not fit: {len(missing)} tensor(s) missing, e.g. "
            f"{next(iter(missing), None)}; {len(unexpected)} unexpected, e.g. {next(iter(unexpected), None)}"
        )
    set_peft_model_state_dict(model, tensors, adapter_name=name)


def adapter_config_json(model: nn.Module, name: str | None = None) -> bytes:
    """The ``adapter_config.json`` PEFT writes beside the weights of adapter ``name`` (None: the active one)."""
    config = model.peft_config[name or model.active_adapter].to_dict()
    config = {key: sorted(value) if isinstance(value, set) else value for key, value in config.items()}
    return json.dumps(config, indent=2, sort_keys=True).encode()


def synced_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a weight sync sends to an inference copy: the adapter's tensors of a PEFT model (under the
    model's own ``state_dict`` names), else every parameter and buffer. Detached, on the model's device."""
    state = model.state_dict()
    if has_adapter(model):
        state = {name: tensor for name, tensor in state.items() if "lora_" in name}
    return {name: tensor.detach() for name, tensor in state.items()}


def load_synced_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a ``synced_state`` into an inference copy of the same model (partial for an adapter)."""
    if not has_adapter(model):
        model.load_state_dict(state)
        return
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"synced weights do not fit the inference copy: {result.unexpected_keys[0]} is not in it")


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights of ``model`` without its LoRA adapters, named as in the base Hugging Face model."""
    if not has_adapter(model):
        return dict(model.state_dict())
    prefix = "base_model.model."
    return {
        name.removeprefix(prefix).replace(".base_layer.", "."): tensor
        for name, tensor in model.state_dict().items()
        if "lora_" not in name
    }


def save_base_model(model: nn.Module, tokenizer, directory: str | Path) -> Path:
    """Save ``model`` (its base, without adapters, if it is a PEFT model) and ``tokenizer`` in Hugging Face format
    into ``directory``, loadable by ``from_pretrained`` and by inference engines; returns it."""
    directory = Path(directory)
    base = model.get_base_model() if has_adapter(model) else model
    base.save_pretrained(directory, state_dict=base_state_dict(model), safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory
