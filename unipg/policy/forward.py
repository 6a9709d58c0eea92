"""Forward passes of a causal LM over left-padded prompts followed by right-padded completions.

Prompts are left-padded and completions right-padded, so every completion starts at the same column and the
lm_head only runs over the completion span (``logits_to_keep``). ``prefill`` runs prompts into a KV cache and
``completion_forward`` gives the logits (and hidden states) that predict each completion token; both run each
distinct prompt once when the rows of a batch share it (the samples of a GRPO group do). The padding,
position, cache and log-prob helpers here are shared by generation (``unipg.policy.generation``) and
evaluation (``unipg.policy.lm``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn

from unipg.estimate.losses import entropy_from_logits

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
    logits: torch.Tensor  # (B, C, V) the logits that predict each completion token
    hidden: torch.Tensor | None  # (B, C, H) last hidden state at the same positions (the state before token t)


def plain_cache(cache) -> bool:
    """Prompt sharing needs a cache whose rows can be gathered: plain full-attention layers only."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return (
        bool(layers) and all(type(layer) is DynamicLayer for layer in layers) and hasattr(cache, "batch_select_indices")
    )


def completion_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_length: int,
    *,
    hidden: bool = False,
    share_prompts: bool = True,
) -> CompletionForward:
    """Forward pass over prompts + completions that runs each distinct prompt once.

    The samples of a GRPO group share their prompt, so the prompt's keys and values are computed once per
    distinct prompt and gathered for every row, and only the completion tokens run per row (the prefix
    caching of inference engines, applied to the training and reference passes too). Gradients flow
    through the shared prompt states. Falls back to one plain forward when no prompt repeats or the
    model's cache cannot be gathered.
    """
    width = input_ids.shape[1] - completion_length
    cache = new_cache(model) if share_prompts and width > 0 else None
    if cache is None or not plain_cache(cache) or not _repeats(input_ids[:, :width]):
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions(attention_mask),
            use_cache=False,
            logits_to_keep=completion_length + 1,
            output_hidden_states=hidden,
        )
        return CompletionForward(
            out.logits[:, :-1], out.hidden_states[-1][:, -(completion_length + 1) : -1] if hidden else None
        )
    first_logits, first_hidden = prefill(model, input_ids[:, :width], attention_mask[:, :width], cache, hidden=hidden)
    rest = model(
        input_ids=input_ids[:, width:],
        attention_mask=attention_mask,
        position_ids=positions(attention_mask)[:, width:],
        use_cache=True,
        output_hidden_states=hidden,
        **{cache_keyword(model): cache},
    )
    logits = torch.cat([first_logits[:, None], rest.logits[:, :-1]], dim=1)
    states = torch.cat([first_hidden[:, None], rest.hidden_states[-1][:, :-1]], dim=1) if hidden else None
    return CompletionForward(logits, states)


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run left-padded prompts (B, P) into ``cache``; each distinct prompt once when ``share`` and the cache's
    rows can be gathered. Returns the last position's logits (B, V) and last hidden state (B, H) or None.
    """
    keyword = cache_keyword(model)
    unique, inverse = torch.unique(prompt_ids, dim=0, return_inverse=True)
    if share and len(unique) < len(prompt_ids) and plain_cache(cache):
        first = torch.zeros(len(unique), dtype=torch.long, device=prompt_ids.device)
        first.scatter_(0, inverse, torch.arange(len(inverse), device=prompt_ids.device))  # a row of each prompt
        prompt_ids, prompt_mask, rows = unique, prompt_mask[first], inverse
    else:
        rows = torch.arange(len(prompt_ids), device=prompt_ids.device)
    out = model(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=positions(prompt_mask),
        use_cache=True,
        logits_to_keep=1,
        output_hidden_states=hidden,
        **{keyword: cache},
    )
    if len(rows) > len(prompt_ids):
        cache.batch_select_indices(rows)
    return out.logits[rows, -1], out.hidden_states[-1][rows, -1] if hidden else None


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits in float32, divided by the sampling temperature (greedy, 0, keeps them as they are)."""
    logits = logits.float()
    return logits / temperature if temperature > 0 and temperature != 1.0 else logits


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits) at the target tokens: (B, C, V), (B, C) → (B, C)."""
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)


def chunked_token_statistics(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_tokens: int | None,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs of ``targets``, entropy or None), each shaped like ``targets``, from (..., V) ``logits``
    taken ``chunk_tokens`` positions at a time (None: all at once).

    Each chunk's log-softmax is recomputed in the backward pass (activation checkpointing), so autograd holds
    the logits only, never a (tokens, V) log-softmax or softmax beside them; equal to ``token_logprobs`` and
    ``entropy_from_logits`` up to float rounding. The entropy is differentiable only with ``entropy_grad``.
    """
    from torch.utils.checkpoint import checkpoint

    if chunk_tokens is None:
        logprobs = token_logprobs(logits, targets)
        return logprobs, entropy_from_logits(logits if entropy_grad else logits.detach()) if with_entropy else None
    flat_logits, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    logprobs, entropies = [], []
    for start in range(0, len(flat_targets), chunk_tokens):
        piece = slice(start, start + chunk_tokens)
        if torch.is_grad_enabled() and flat_logits.requires_grad:
            logprob, entropy = checkpoint(
                _chunk_statistics,
                flat_logits[piece],
                flat_targets[piece],
                with_entropy,
                entropy_grad,
                use_reentrant=False,
            )
        else:
            logprob, entropy = _chunk_statistics(flat_logits[piece], flat_targets[piece], with_entropy, entropy_grad)
        logprobs.append(logprob)
        entropies.append(entropy)
    entropy = torch.cat(entropies).view_as(targets) if with_entropy else None
    return torch.cat(logprobs).view_as(targets), entropy


def _chunk_statistics(
    logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    logprob = token_logprobs(logits, targets)
    if not with_entropy:
        return logprob, logprob.new_zeros(())
    return logprob, entropy_from_logits(logits if entropy_grad else logits.detach())
