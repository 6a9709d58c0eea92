"""Attention over a packed row, one segment (sequence) at a time, so that its cost is linear in the segments.

A packed row (``unipg.policy.packed``) holds S sequences, N tokens in all. Left to Hugging Face, an sdpa model
derives a block-diagonal causal mask from the position resets, an (N, N) tensor that attention then reads in full:
the pass costs O(N²) in the micro-batch's token budget N although each sequence attends only to itself. Here each
segment of length Lᵢ runs its own causal ``scaled_dot_product_attention``, Σ Lᵢ² in all, and no mask is built.

The segments reach the attention function as Hugging Face's variable-length keywords (``cu_seq_lens_q`` /
``cu_seq_lens_k``: the (S + 1,) cumulative segment lengths), which every decoder layer forwards to its attention
function, also when a checkpointed layer recomputes its forward in the backward pass.

``SEGMENT_ATTENTION`` is registered with Hugging Face's ``AttentionInterface`` and ``AttentionMaskInterface``.
``use_segment_attention`` sets it as an sdpa model's implementation, once and for good rather than around each
packed pass, because a checkpointed layer runs its forward again in the backward pass, after any such pass has
ended. Outside packed passes it is plain sdpa: without segment keywords the attention function hands its call to
sdpa's, and the mask function builds sdpa's mask unless a packed pass (``packed_pass``) is running, which needs
none. Models on flash attention keep their own variable-length path (it reads the segments off the position
resets); other implementations keep the dense mask.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

SEGMENT_ATTENTION = "unipg_segments"  # sdpa, with a packed row's attention computed segment by segment
BASE_ATTENTION = "sdpa"  # the implementation it stands in for (and hands every other pass to)
# Attention keywords that change the scores in ways a plain causal softmax does not reproduce.
UNSUPPORTED_KEYWORDS = ("softcap", "s_aux", "position_bias")

_packed_pass = contextvars.ContextVar("packed_pass", default=False)


def segment_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Hugging Face attention function: query (1, H, N, D), key/value (1, H_kv, N, D) of a packed row whose
    segments ``kwargs["cu_seq_lens_q"]`` gives → ((1, N, H, D), None); any other call goes to sdpa's."""
    boundaries = kwargs.get("cu_seq_lens_q")
    if boundaries is None:
        return ALL_ATTENTION_FUNCTIONS[BASE_ATTENTION](module, query, key, value, attention_mask, **kwargs)
    _check_packed_call(query, key, attention_mask, kwargs)
    lengths = boundaries.diff().tolist()
    branches, window = kwargs.get("segment_branches"), kwargs.get("sliding_window")
    masks = [None] * len(lengths) if branches is None else [branch_mask(b, window) for b in branches.split(lengths)]
    outputs = [
        causal_attention(
            q,
            k,
            v,
            scaling=kwargs.get("scaling"),
            dropout=kwargs.get("dropout", 0.0),
            sliding_window=kwargs.get("sliding_window"),
            enable_gqa=getattr(module, "num_key_value_groups", 1) > 1,
            mask=mask,
        )
        for q, k, v, mask in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2), masks)
    ]
    return torch.cat(outputs, 2).transpose(1, 2).contiguous(), None


def branch_mask(branches: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """(L, L) who attends to whom in a shared-prompt segment (``unipg.policy.packed``): a token sees the tokens
    before it that are the prompt's (branch 0) or its own completion's; with a sliding window W, only those fewer
    than W positions back (a completion's positions continue its prompt's)."""
    index = torch.arange(len(branches), device=branches.device)
    mask = (index[None, :] <= index[:, None]) & ((branches[None, :] == 0) | (branches[None, :] == branches[:, None]))
    if sliding_window is not None and len(branches) > sliding_window:
        change = torch.ones_like(branches, dtype=torch.bool)
        change[1:] = branches[1:] != branches[:-1]
        start = torch.cummax(torch.where(change, index, 0), 0).values  # where each token's branch begins
        position = torch.where(branches == 0, index, int((branches == 0).sum()) + index - start)
        mask &= position[:, None] - position[None, :] < sliding_window
    return mask


def causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scaling: float | None,
    dropout: float,
    sliding_window: int | None,
    enable_gqa: bool,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q kᵀ · scaling + causal mask) v for one sequence, (1, H, L, D); with a sliding window W, token i
    attends to tokens j with i − W < j ≤ i (Hugging Face's ``sliding_window_overlay``); ``mask`` (L, L), when
    given, says who attends to whom instead."""
    length = query.shape[2]
    band = mask
    if mask is None and sliding_window is not None and length > sliding_window:
        index = torch.arange(length, device=query.device)
        distance = index[:, None] - index[None, :]
        band = (distance >= 0) & (distance < sliding_window)
    return F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=band,
        dropout_p=dropout,
        is_causal=band is None,
        scale=scaling,
        enable_gqa=enable_gqa,
    )


def _check_packed_call(query: torch.Tensor, key: torch.Tensor, attention_mask, kwargs: dict) -> None:
    """A packed call is one row, self-attention without a cache or mask, and plain causal scores."""
    if query.shape[0] != 1 or query.shape[2] != key.shape[2] or attention_mask is not None:
        raise ValueError(
            "segment attention takes one packed row without a cache or attention mask; got query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}, mask {'set' if attention_mask is not None else 'None'}"
        )
    if kwargs.get("is_causal") is False:
        raise ValueError("segment attention is causal; this layer attends bidirectionally (set packing off)")
    unsupported = [name for name in UNSUPPORTED_KEYWORDS if kwargs.get(name) is not None]
    if unsupported:
        raise ValueError(
            f"this model's attention uses {', '.join(unsupported)}, which packed passes do not support; "
            "set train.max_tokens_per_micro_batch to null to train it with padded micro-batches"
        )


def segment_attention_mask(*args, **kwargs) -> torch.Tensor | None:
    """Hugging Face mask function: no mask during a packed pass (segments bound the attention), sdpa's otherwise."""
    if _packed_pass.get():
        return None
    return ALL_MASK_ATTENTION_FUNCTIONS[BASE_ATTENTION](*args, **kwargs)


@contextlib.contextmanager
def packed_pass():
    """Mark the forward passes run inside as packed: models on segment attention build no attention mask."""
    token = _packed_pass.set(True)
    try:
        yield
    finally:
        _packed_pass.reset(token)


def use_segment_attention(model: nn.Module) -> bool:
    """Put an sdpa ``model``'s decoder on segment attention (no change to any other pass, module docstring);
    returns whether the model's packed passes run on it (False: flash or another implementation of its own)."""
    config = model.config.get_text_config()
    if config._attn_implementation == BASE_ATTENTION:
        config._attn_implementation = SEGMENT_ATTENTION
    return config._attn_implementation == SEGMENT_ATTENTION


AttentionInterface.register(SEGMENT_ATTENTION, segment_attention)
AttentionMaskInterface.register(SEGMENT_ATTENTION, segment_attention_mask)
