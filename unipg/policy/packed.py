"""Padding-free forward passes: the rows of a (B, P + C) batch packed into one row of their real tokens.

A micro-batch of agent trajectories is length-skewed: padding every row to the longest one spends most of
the forward and backward pass on pad tokens. Packing concatenates the real tokens of all rows into a single
row (1, N) whose ``position_ids`` restart at 0 for every sequence, so that no token attends across sequences:
sdpa models attend segment by segment (``unipg.policy.segment_attention``, linear in the segments), flash
attention derives the per-sequence lengths from the position resets, and other implementations (eager) get the
block-diagonal causal mask Hugging Face derives from them (an (N, N) tensor, quadratic in N).

Only the positions that predict a completion token are kept (``logits_to_keep`` as an index tensor), and the
policy takes their hidden states, not logits (``unipg.policy.token_logprobs``). Per-token results come back flat, (M,) for the M completion tokens, and ``Packing.unpack`` lays
them out in the (B, C) grid the objective reads, with 0 where a row has no real token.

With ``share_prompts``, rows that repeat a prompt (a GRPO group) share it: the row holds each distinct prompt once,
followed by the completions of its rows, every completion attending to the prompt and to itself
(``unipg.policy.segment_attention``: one segment per distinct prompt, each token's branch telling which completion it
belongs to, 0 for the prompt). A group of 8 completions of a 7-token prompt then computes 7 + Σ completions tokens
instead of 8 × 7 + Σ completions; the gradient reaching the prompt is the sum over its completions, as unshared.

Rows must be left-padded prompts followed by right-padded completions, real tokens contiguous (the
``LMBatch`` layout). A completion token without a token before it in its row (an empty prompt) has no
prediction and is left at 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from unipg.policy.forward import final_states, positions
from unipg.policy.segment_attention import packed_pass, use_segment_attention


@dataclass
class Packing:
    """B rows of a padded batch as one packed row; M = the real completion tokens that have a predecessor."""

    input_ids: torch.Tensor  # (1, N) the real tokens of every row, row after row
    position_ids: torch.Tensor  # (1, N) each token's position within its own sequence (0 at its first token)
    predictors: torch.Tensor  # (M,) long, the packed index of the token whose output predicts each target
    targets: torch.Tensor  # (M,) long, the completion tokens
    rows: torch.Tensor  # (M,) long, each target's row in the (B, C) grid
    columns: torch.Tensor  # (M,) long, each target's column in the (B, C) grid
    shape: tuple[int, int]  # (B, C)
    boundaries: torch.Tensor  # (S + 1,) int32, where each of the S non-empty sequences starts in the row, then N
    longest: int  # tokens of the longest sequence
    branches: torch.Tensor | None = None  # (N,) with shared prompts: 0 on a prompt, a completion's own id on it

    def segments(self) -> dict:
        """The segments as Hugging Face's variable-length attention keywords (and, with shared prompts, the
        branches that segment attention reads)."""
        shared = {} if self.branches is None else {"segment_branches": self.branches}
        return {
            "cu_seq_lens_q": self.boundaries,
            "cu_seq_lens_k": self.boundaries,
            "max_length_q": self.longest,
            "max_length_k": self.longest,
            **shared,
        }

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """(M, ...) per-token values → (B, C, ...) with zeros where no target is; differentiable."""
        grid = values.new_zeros((*self.shape, *values.shape[1:]))
        return grid.index_put((self.rows, self.columns), values)


def prompt_index(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """(B,) each row's index among the batch's distinct prompts (same tokens, same padding)."""
    key = torch.cat([input_ids[:, :prompt_width], attention_mask[:, :prompt_width]], 1)
    return torch.unique(key, dim=0, return_inverse=True)[1]


def pack_rows(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int, *, share_prompts: bool = False
) -> Packing:
    """Pack the real tokens of (B, P + C) left-padded prompts + right-padded completions into one row; with
    ``share_prompts`` each distinct prompt once, when some prompt repeats (module docstring)."""
    if share_prompts and (shared := _pack_shared_prompts(input_ids, attention_mask, completion_length)) is not None:
        return shared
    real = attention_mask.bool()
    flat_index = (real.flatten().cumsum(0) - 1).view_as(real)  # (B, L) packed index of each real token
    position = positions(attention_mask)
    prompt_width = input_ids.shape[1] - completion_length
    completion_real = real[:, prompt_width:] & (position[:, prompt_width:] > 0)  # (B, C) has a predecessor
    rows, columns = completion_real.nonzero(as_tuple=True)
    lengths = real.sum(1)
    lengths = lengths[lengths > 0]
    return Packing(
        input_ids=input_ids[real][None],
        position_ids=position[real][None],
        predictors=flat_index[rows, prompt_width + columns] - 1,
        targets=input_ids[rows, prompt_width + columns],
        rows=rows,
        columns=columns,
        shape=(input_ids.shape[0], completion_length),
        boundaries=torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32),
        longest=int(lengths.max()) if len(lengths) else 0,
    )


def _pack_shared_prompts(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int
) -> Packing | None:
    """The shared-prompt layout; None where nothing repeats or a prompt is empty (nothing to share then)."""
    width = input_ids.shape[1] - completion_length
    real = attention_mask.bool()
    if width == 0 or not bool(real[:, :width].any(1).all()):
        return None
    group = prompt_index(input_ids, attention_mask, width)
    count = int(group.max()) + 1
    if count == len(group):
        return None
    order = torch.argsort(group, stable=True)  # rows of a prompt together, in their own order
    group, real, ids = group[order], real[order], input_ids[order]
    position = positions(attention_mask[order])
    first = torch.ones_like(group, dtype=torch.bool)
    first[1:] = group[1:] != group[:-1]  # the row that carries its group's prompt
    keep = real.clone()
    keep[:, :width] &= first[:, None]
    packed_index = (keep.flatten().cumsum(0) - 1).view_as(keep)
    leader = torch.cummax(
        torch.where(first, torch.arange(len(group), device=group.device), 0), 0
    ).values  # each row's first row
    packed_index[:, :width] = packed_index[leader, :width]  # a shared prompt's tokens, as the first row has them
    rows, columns = real[:, width:].nonzero(as_tuple=True)
    branch = torch.zeros_like(ids)
    branch[:, width:] = torch.arange(1, len(group) + 1, device=ids.device)[:, None]
    lengths = torch.zeros(count, dtype=torch.long, device=ids.device).index_add_(0, group, keep.sum(1))
    lengths = lengths[lengths > 0]
    return Packing(
        input_ids=ids[keep][None],
        position_ids=position[keep][None],
        predictors=packed_index[rows, width + columns - 1],
        targets=ids[rows, width + columns],
        rows=order[rows],
        columns=columns,
        shape=(input_ids.shape[0], completion_length),
        boundaries=torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32),
        longest=int(lengths.max()),
        branches=branch[keep],
    )


@dataclass
class PackedForward:
    logits: torch.Tensor | None  # (M, V) the logits that predict each target; None unless asked for
    hidden: torch.Tensor | None  # (M, H) last hidden state at the same positions; None unless asked for


def packed_forward(model: nn.Module, packing: Packing, *, logits: bool = True, hidden: bool = False) -> PackedForward:
    """One forward pass over the packed row; the lm_head runs only at the predicting positions, and only with
    ``logits`` (``unipg.policy.forward.final_states``)."""
    segments = packing.segments() if use_segment_attention(model) else {}
    if packing.branches is not None and not segments:
        raise ValueError("shared-prompt packing needs segment attention; pack without share_prompts for this model")
    with packed_pass():
        all_logits, states = final_states(
            model,
            packing.predictors,
            logits=logits,
            hidden=hidden,
            input_ids=packing.input_ids,
            position_ids=packing.position_ids,
            attention_mask=None,
            use_cache=False,
            **segments,
        )
    return PackedForward(all_logits[0] if logits else None, states[0] if hidden else None)


def packed_hidden(model: nn.Module, packing: Packing) -> torch.Tensor:
    """(M, H) the last hidden state at the predicting positions (the input of the lm_head, or of a value head)."""
    return packed_forward(model, packing, logits=False, hidden=True).hidden
