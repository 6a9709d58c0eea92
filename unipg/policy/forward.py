"""Forward passes of a causal LM over left-padded prompts followed by right-padded completions.

Prompts are left-padded and completions right-padded, so every completion starts at the same column and the
lm_head only runs over the completion span (``logits_to_keep``). ``prefill`` runs prompts into a KV cache and
``completion_forward`` gives the hidden states (or logits) that predict each completion token; both run each
distinct prompt once when the rows of a batch share it (the samples of a GRPO group do). The padding,
position, cache and logit-scaling helpers here are shared by generation (``unipg.policy.generation``) and
evaluation (``unipg.policy.lm``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn

# Config attributes under which Hugging Face architectures give the number of positions they were built for.
CONTEXT_ATTRIBUTES = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")


def context_length(model: nn.Module) -> int | None:
    """The longest sequence (prompt + completion) the model has positions for, or None when its config does
    not say. Past it a model with learned position embeddings fails with an index error, and a rotary one
    runs on positions it was never trained on."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in CONTEXT_ATTRIBUTES:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def cache_keyword(model: nn.Module) -> str:
    """Newer transformers name the KV-cache argument ``cache``; older ones ``past_key_values``."""
    return _cache_keyword_of(type(model))


@functools.cache
def _cache_keyword_of(model_class: type) -> str:  # signature inspection is slow; every forward asks
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


@contextlib.contextmanager
def recomputing(model: nn.Module):
    """Turn on the gradient checkpointing of ``model``'s layers for a differentiable pass; yields whether any is.

    Hugging Face layers enabled with ``gradient_checkpointing_enable`` recompute their activations in the
    backward pass only in training mode, and the policy stays in eval mode (no dropout). So, while gradients
    are recorded, only those layers' own ``training`` flags are set, not their submodules' (dropout stays off).
    Checkpointed layers drop a KV cache, so a caller must not share prompts through one in such a pass.
    """
    layers = (
        [
            module
            for module in model.modules()
            if getattr(module, "gradient_checkpointing", False) is True
            and hasattr(module, "_gradient_checkpointing_func")
        ]
        if torch.is_grad_enabled()
        else []
    )
    modes = [layer.training for layer in layers]
    for layer in layers:
        layer.training = True
    try:
        yield bool(layers)
    finally:
        for layer, mode in zip(layers, modes):
            layer.training = mode


def new_cache(model: nn.Module):
    from transformers.cache_utils import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # transformers < 4.56 builds the cache lazily
        return DynamicCache()


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding: the first real token is at position 0."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists → (ids, mask), both (B, P), padded on the left."""
    width = max(len(ids) for ids in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, tokens in enumerate(sequences):
        if tokens:
            ids[row, width - len(tokens) :] = torch.tensor(tokens, dtype=torch.long)
            mask[row, width - len(tokens) :] = 1
    return ids, mask


@dataclass
class CompletionForward:
    hidden: torch.Tensor | None  # (B, C, H) the decoder's last hidden state before each completion token (what
    # predicts it); None unless asked for
    logits: torch.Tensor | None  # (B, C, V) the model's logits at the same positions; None unless asked for


def plain_cache(cache) -> bool:
    """Prompt sharing needs a cache whose rows can be gathered: plain full-attention layers only."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return (
        bool(layers) and all(type(layer) is DynamicLayer for layer in layers) and hasattr(cache, "batch_select_indices")
    )


def final_states(
    model: nn.Module, keep: int | torch.Tensor, *, logits: bool = False, hidden: bool = True, **inputs
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One forward pass of ``model`` on ``inputs``; returns (logits, last hidden state) at the positions ``keep``
    selects in each row (an int: the last ``keep``; a (K,) long tensor: those), each None unless asked for.

    No logits are computed but those asked for: a causal LM runs its lm_head over no position then
    (``logits_to_keep`` of none), and its decoder's output is read by a forward hook on the decoder, so that the
    model's own forward still runs (a sharded model gathers its weights in it). A bare decoder (a critic's
    backbone: no lm_head) returns its last hidden state itself; a model without a separate decoder is asked for
    its hidden states (``output_hidden_states``).
    """
    if _bare_decoder(model):
        states = model(**inputs).last_hidden_state
        return None, _kept(states, keep) if hidden else None
    decoder = model.get_decoder() if hidden and hasattr(model, "get_decoder") else model
    captured: list[torch.Tensor] = []
    hooks = [] if decoder is model else [decoder.register_forward_hook(lambda *call: captured.append(call[2][0]))]
    try:
        nothing = torch.zeros(0, dtype=torch.long, device=inputs["input_ids"].device)
        out = model(**inputs, logits_to_keep=keep if logits else nothing, output_hidden_states=hidden and not hooks)
    finally:
        for hook in hooks:
            hook.remove()
    states = (captured[-1] if hooks else out.hidden_states[-1]) if hidden else None
    return out.logits if logits else None, _kept(states, keep) if hidden else None


def _bare_decoder(model: nn.Module) -> bool:
    """A transformer without an lm_head (``get_output_embeddings`` None), e.g. a causal LM's ``get_decoder()``."""
    return hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is None


def _kept(states: torch.Tensor, keep: int | torch.Tensor) -> torch.Tensor:
    return states[:, -keep:] if isinstance(keep, int) else states[:, keep]


def completion_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_length: int,
    *,
    logits: bool = False,
    hidden: bool = True,
    share_prompts: bool = True,
) -> CompletionForward:
    """Forward pass over prompts + completions that runs each distinct prompt once; the hidden states and the
    logits that predict each completion token, each as asked for (``final_states``).

    The samples of a GRPO group share their prompt, so the prompt's keys and values are computed once per
    distinct prompt and gathered for every row, and only the completion tokens run per row (the prefix
    caching of inference engines, applied to the training and reference passes too). Gradients flow
    through the shared prompt states. Falls back to one plain forward when no prompt repeats or the
    model's cache cannot be gathered.
    """
    asked = {"logits": logits, "hidden": hidden}
    width = input_ids.shape[1] - completion_length
    cache = new_cache(model) if share_prompts and width > 0 else None
    if cache is None or not plain_cache(cache) or not _repeats(input_ids[:, :width]):
        all_logits, states = final_states(
            model,
            completion_length + 1,
            **asked,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions(attention_mask),
            use_cache=False,
        )
        return CompletionForward(
            hidden=None if states is None else states[:, :-1],
            logits=None if all_logits is None else all_logits[:, :-1],
        )
    first = prefill(model, input_ids[:, :width], attention_mask[:, :width], cache, **asked)
    rest = final_states(
        model,
        completion_length,
        **asked,
        input_ids=input_ids[:, width:],
        attention_mask=attention_mask,
        position_ids=positions(attention_mask)[:, width:],
        use_cache=True,
        **{cache_keyword(model): cache},
    )
    # the last prompt position predicts the first completion token; the last completion position predicts none
    joined = [
        None if head is None else torch.cat([head[:, None], tail[:, :-1]], dim=1) for head, tail in zip(first, rest)
    ]
    return CompletionForward(hidden=joined[1], logits=joined[0])


def _repeats(prompt_ids: torch.Tensor) -> bool:
    return len(torch.unique(prompt_ids, dim=0)) < len(prompt_ids)


def prefill(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    cache,
    *,
    share: bool = True,
    hidden: bool = False,
    logits: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Run left-padded prompts (B, P) into ``cache``; each distinct prompt once when ``share`` and the cache's
    rows can be gathered. Returns the last position's logits (B, V) or None (without ``logits``), and its last
    hidden state (B, H) or None (without ``hidden``).
    """
    unique, inverse = torch.unique(prompt_ids, dim=0, return_inverse=True)
    if share and len(unique) < len(prompt_ids) and plain_cache(cache):
        first = torch.zeros(len(unique), dtype=torch.long, device=prompt_ids.device)
        first.scatter_(0, inverse, torch.arange(len(inverse), device=prompt_ids.device))  # a row of each prompt
        prompt_ids, prompt_mask, rows = unique, prompt_mask[first], inverse
    else:
        rows = torch.arange(len(prompt_ids), device=prompt_ids.device)
    last_logits, states = final_states(
        model,
        1,
        logits=logits,
        hidden=hidden,
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=positions(prompt_mask),
        use_cache=True,
        **{cache_keyword(model): cache},
    )
    if len(rows) > len(prompt_ids):
        cache.batch_select_indices(rows)
    return last_logits[rows, -1] if logits else None, states[rows, -1] if hidden else None


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits in float32, divided by the sampling temperature (greedy, 0, keeps them as they are)."""
    logits = logits.float()
    return logits / temperature if temperature > 0 and temperature != 1.0 else logits
