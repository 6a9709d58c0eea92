"""LoRA adapters as files: what an inference engine loads when only the adapter changes between versions."""

from __future__ import annotations

from pathlib import Path

import torch


def is_adapted(model) -> bool:
    """Whether ``model`` is a PEFT model (LoRA adapters on a frozen base)."""
    return hasattr(model, "peft_config")


def save_adapter(model, directory: str | Path) -> Path:
    """Save ``model``'s LoRA adapter in PEFT format (``adapter_config.json`` + ``adapter_model.safetensors``)
    into ``directory``; returns it."""
    if not is_adapted(model):
        raise ValueError("save_adapter needs a PEFT model (model.lora_rank > 0); save full models with "
                         "save_pretrained")
    directory = Path(directory)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def changing_state_dict(model) -> dict[str, torch.Tensor]:
    """The weights an update changes, as ``model.state_dict()`` names them: only the LoRA adapters of a PEFT
    model (load them with ``load_state_dict(..., strict=False)``), every weight otherwise."""
    state = model.state_dict()
    return {name: tensor for name, tensor in state.items() if "lora_" in name} if is_adapted(model) else dict(state)


def base_state_dict(model) -> dict[str, torch.Tensor]:
    """The weights of ``model`` without its LoRA adapters, named as in the base Hugging Face model."""
    if not is_adapted(model):
        return dict(model.state_dict())
    prefix = "base_model.model."
    return {name.removeprefix(prefix).replace(".base_layer.", "."): tensor
            for name, tensor in model.state_dict().items() if "lora_" not in name}


def save_base_model(model, tokenizer, directory: str | Path) -> Path:
    """Save ``model`` (its base, without adapters, if it is a PEFT model) and ``tokenizer`` in Hugging Face format
    into ``directory``, loadable by ``from_pretrained`` and by inference engines; returns it."""
    directory = Path(directory)
    base = model.get_base_model() if is_adapted(model) else model
    base.save_pretrained(directory, state_dict=base_state_dict(model), safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory
