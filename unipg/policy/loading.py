"""Loading a language-model policy from a hub id, a local folder or the embedded model.

Loading goes through ``from_pretrained`` exactly as for any Hugging Face model; what this module adds is
errors that say what to fix (a missing folder, a tokenizer without a pad token, a missing optional
package) instead of a traceback from deep inside transformers, and the assembly of the policy's parts:
value head or separate critic, frozen reference, LoRA adapters.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from unipg.config import ConfigError
from unipg.config.devices import resolve_device, torch_dtype
from unipg.policy.chat import check_tokenizer
from unipg.policy.embedded import resolve_model_name
from unipg.policy.lm import VALUE_HEAD_FILE, CriticModel, LMPolicy
from unipg.policy.role_policies import RolePolicies
from unipg.policy.templates import prepare_chat_template


def _looks_like_path(name: str) -> bool:
    """A hub id is 'name' or 'org/name'; anything else (./x, /x, ~/x, a/b/c) is meant as a folder."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name).exists()


def _check_exists(name: str, resolved: str) -> None:
    if _looks_like_path(resolved) and not Path(resolved).expanduser().exists():
        raise ValueError(
            f"model '{name}' not found: '{resolved}' is not a folder; pass an existing folder written "
            "by save_pretrained, a Hugging Face hub id, or 'embedded'"
        )


def load_tokenizer(name: str, *, trust_remote_code: bool = False, chat_template: str | None = None):
    """The tokenizer of model ``name``, with a pad token, and with ``chat_template`` (``model.chat_template``) or a
    chat template fit for multi-turn rollouts (``prepare_chat_template``)."""
    from transformers import AutoTokenizer

    resolved = resolve_model_name(name)
    _check_exists(name, resolved)
    try:
        if _is_character_tokenizer(resolved):
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast.from_pretrained(resolved)
        else:
            tokenizer = AutoTokenizer.from_pretrained(resolved, trust_remote_code=trust_remote_code)
    except Exception as error:  # noqa: BLE001  a damaged file fails in the words of json, tokenizers, ...
        raise ValueError(
            f"could not load a tokenizer for model '{name}' ({resolved}): {first_line(error)}. "
            "Check the hub id or that the folder holds intact tokenizer files"
        ) from None
    return check_tokenizer(prepare_chat_template(tokenizer, chat_template, model=name), name)


def _is_character_tokenizer(resolved: str) -> bool:
    """Whether a local folder holds the embedded character-level tokenizer (to be loaded as written)."""
    from unipg.policy.embedded import CHARACTER_TOKENIZER_FLAG

    config = Path(resolved) / "tokenizer_config.json"
    try:
        return bool(json.loads(config.read_text(encoding="utf-8")).get(CHARACTER_TOKENIZER_FLAG))
    except (OSError, ValueError):
        return False


def load_causal_lm(
    name: str, *, dtype: str = "float32", trust_remote_code: bool = False, device: torch.device | str | None = None
):
    """The causal LM ``name`` with parameters of ``dtype``, on ``device`` (None: where it loads, the CPU)."""
    from transformers import AutoModelForCausalLM

    resolved = resolve_model_name(name)
    _check_exists(name, resolved)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            resolved, dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code
        )
    except Exception as error:  # noqa: BLE001  a truncated weights file fails in safetensors' or torch's words
        raise ValueError(
            f"could not load a causal language model from '{name}' ({resolved}): {first_line(error)}. "
            "Pass a hub id or a folder written by save_pretrained whose files are whole (a truncated or damaged "
            "weights file is copied again from where it came from)"
        ) from None
    return model if device is None else model.to(device)


def first_line(error: Exception) -> str:
    """The error's type and the first line of its message."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def apply_lora(model, *, rank: int, alpha: float, target_modules, roles: list[str] = ()):
    """``model`` wrapped with a LoRA adapter (PEFT's ``default``), or with ``roles``, one adapter per role named after
    it (``agent.role_policy: adapters``), the first one active; every adapter is trainable."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ValueError("model.lora_rank > 0 needs the peft package: pip install 'unipg[peft]'") from None
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"
    )
    if not roles:
        return get_peft_model(model, config)
    model = get_peft_model(model, config, adapter_name=roles[0])
    for role in roles[1:]:
        model.add_adapter(role, config)
    model.set_adapter(roles[0])
    for name, parameter in model.named_parameters():
        parameter.requires_grad_("lora_" in name)
    return model


def reference_mode(requested: str, *, needs_reference: bool, lora: bool) -> str:
    """'auto' holds a reference only when the KL needs one; with LoRA the reference is the base model."""
    if requested == "none" or (requested == "auto" and not needs_reference):
        return "none"
    return "adapter" if lora else "copy"


def load_lm_policy(
    name: str,
    *,
    dtype: str = "float32",
    value_head: bool = False,
    critic: str | None = None,
    reference: str = "auto",
    needs_reference: bool = False,
    lora_rank: int = 0,
    lora_alpha: float = 16.0,
    lora_target_modules="all-linear",
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
    device: torch.device | str | None = None,
    chat_template: str | None = None,
    roles: list[str] = (),
) -> LMPolicy:
    """Assemble an ``LMPolicy`` on ``device`` (None: the CPU): the LM, critic and reference in ``dtype``, a value
    head in float32; a value head saved beside the model (``LMPolicy.save``) is loaded back. ``roles``: one LoRA
    adapter per role instead of one (``agent.role_policy: adapters``; needs ``lora_rank`` > 0)."""
    tokenizer = load_tokenizer(name, trust_remote_code=trust_remote_code, chat_template=chat_template)
    model = load_causal_lm(name, dtype=dtype, trust_remote_code=trust_remote_code)
    if model.config.vocab_size < len(tokenizer):
        raise ValueError(
            f"tokenizer of '{name}' has {len(tokenizer)} tokens but the model only "
            f"{model.config.vocab_size} embeddings; load a matching tokenizer"
        )
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if lora_rank > 0:
        model = apply_lora(model, rank=lora_rank, alpha=lora_alpha, target_modules=lora_target_modules, roles=roles)
    critic_model = None
    if critic is not None:
        critic_model = CriticModel(load_causal_lm(critic, dtype=dtype, trust_remote_code=trust_remote_code))
        _load_head(critic_model.head, Path(resolve_model_name(critic)))
    policy = LMPolicy(
        model.eval(),
        tokenizer,
        value_head=value_head,
        critic=critic_model,
        reference=reference_mode(reference, needs_reference=needs_reference, lora=lora_rank > 0),
    )
    if policy.value_head is not None:
        _load_head(policy.value_head, Path(resolve_model_name(name)))
    return policy if device is None else policy.to(device)


def _load_head(head: torch.nn.Module, folder: Path) -> None:
    path = folder / VALUE_HEAD_FILE
    if path.is_file():
        try:
            head.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        except Exception as error:  # noqa: BLE001  truncated, or another model's head
            raise ValueError(
                f"could not load the value head {path}: {first_line(error)}. The file is damaged or belongs to "
                "another model; copy it again, or remove it to start the value head afresh"
            ) from None


def policy_from_config(config, roles: list[str] = ()) -> LMPolicy | RolePolicies:
    """The policy a text-task ``Config`` asks for (after any warm start has resolved ``model.name``); ``roles``: the
    task's, which get an adapter each with ``agent.role_policy: adapters``, and a model each (``RolePolicies``)
    with ``agent.role_policy: separate``."""
    model, est = config.model, config.estimator
    role_policy = config.agent.role_policy
    if role_policy != "shared" and not roles:
        what = "a LoRA adapter" if role_policy == "adapters" else "a model"
        raise ConfigError(
            f"agent.role_policy={role_policy} trains {what} per role of a multi-role task, and task "
            f"'{config.task.name}' has one role; set agent.role_policy=shared, or task.name to a multi-role task "
            "(e.g. solver_checker)"
        )
    needs_reference = est.kl_coef > 0 or est.kl_control == "adaptive"
    options = dict(
        dtype=model.dtype,
        value_head=model.value_head,
        critic=model.critic,
        reference=model.reference,
        needs_reference=needs_reference,
        lora_rank=model.lora_rank,
        lora_alpha=model.lora_alpha,
        lora_target_modules=model.lora_target_modules,
        gradient_checkpointing=model.gradient_checkpointing,
        trust_remote_code=model.trust_remote_code,
        device=resolve_device(config.device),
        chat_template=model.chat_template,
    )
    if role_policy == "separate":
        policy = RolePolicies({role: load_lm_policy(role_model_name(config, role), **options) for role in roles})
    else:
        policy = load_lm_policy(model.name, **options, roles=list(roles) if role_policy == "adapters" else [])
    check_policy_fits(policy, config)
    return policy


def role_model_name(config, role: str | None) -> str:
    """The model of ``role`` with ``agent.role_policy: separate``: ``agent.roles.<role>.model``, else ``model.name``
    (also for ``role=None``, the one model of a run without a model per role)."""
    settings = config.agent.roles.get(role) if role is not None else None
    return settings.model if settings is not None and settings.model is not None else config.model.name


def check_policy_fits(policy: LMPolicy, config) -> None:
    """Checks that need the loaded model, made before a run writes anything.

    A completion budget as long as the context leaves no room for any prompt: rejected. A prompt plus its
    completion longer than the context is not: generation stops where the context ends (``LMPolicy.sample``).
    Without an EOS token a completion only ends at a stop string or after max_new_tokens: a warning.
    """
    context, new_tokens, name = policy.context_length, config.sample.max_new_tokens, config.model.name
    if context is not None and new_tokens >= context:
        raise ValueError(
            f"sample.max_new_tokens ({new_tokens}) leaves no room for a prompt in the {context}-token "
            f"context of model '{name}'; lower it below {context}, e.g. sample.max_new_tokens="
            f"{context // 4}"
        )
    if not policy.eos_ids and not config.sample.stop:
        warnings.warn(
            f"the tokenizer of model '{name}' has no EOS token, so every completion runs to "
            "sample.max_new_tokens; set sample.stop (e.g. ['\\n']) or use a tokenizer with an eos_token",
            stacklevel=2,
        )
