"""How a mini-batch's rows become micro-batches: ``train.micro_batch_size`` rows padded to the longest, or rows
packed into padding-free rows of at most a token budget (``unipg.policy.packed``).

``train.max_tokens_per_micro_batch``:

- an integer: always packed, at most that many tokens per micro-batch;
- ``null``: always padded;
- ``auto`` (the default): packed at a budget of ``micro_batch_size`` × the mini-batch's longest sequence — never
  more tokens than a padded micro-batch of the same rows holds, so the peak memory stays that of the padded path —
  unless padding is the faster path, padded then. Padding computes every row to its micro-batch's longest
  completion but each distinct prompt once (``completion_forward`` shares a GRPO group's prompt); packing
  computes every real token, prompts once per row. A padded token costs more than a packed one (the pad
  positions' logits, the masked attention, the gathered prompt cache), so packing stays as fast while it
  computes up to ``PACKED_TOKENS_PER_PADDED_TOKEN`` times the padded path's tokens. Packed attention is linear in
  the sequences (``unipg.policy.segment_attention``), so the budget does not change the time per token.

With ``share_prompts`` (a model on segment attention), a packed row holds each distinct prompt once
(``unipg.policy.packed``), so packing computes fewer tokens than padding whatever the batch: ``auto`` always packs,
and the rows of one prompt stay in one micro-batch where the budget allows (a prompt with its completions is the
unit the budget splits), so that their prompt runs once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unipg.policy.packed import prompt_index

AUTO = "auto"
# Packed tokens as fast as one padded-path token: on shared-prompt batches the two paths took the same time where
# packing computed 1.8-1.9 times the padded path's tokens, 1.22 times as long at 2.6 (benchmarks/learner.py,
# section 2, CPU).
PACKED_TOKENS_PER_PADDED_TOKEN = 1.8


@dataclass
class MicroBatches:
    groups: list[torch.Tensor]  # per micro-batch, the (long) indices of its rows
    packed: bool  # each micro-batch runs as one padding-free row


def plan_micro_batches(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_length: int,
    rows: torch.Tensor,
    *,
    micro_batch_size: int,
    max_tokens: int | str | None,
    share_prompts: bool = False,
) -> MicroBatches:
    """``rows`` of a (B, P + C) batch (left-padded prompts, right-padded completions) split into micro-batches
    under ``max_tokens`` (module docstring)."""
    lengths = attention_mask[rows].sum(1)
    padded = [rows[group] for group in torch.arange(len(rows)).split(micro_batch_size)]
    if max_tokens is None:
        return MicroBatches(padded, packed=False)
    prompt_width = input_ids.shape[1] - completion_length
    if share_prompts:
        budget = micro_batch_size * int(lengths.max()) if max_tokens == AUTO else max_tokens
        prompt_of = prompt_index(input_ids[rows], attention_mask[rows], prompt_width)
        prompt_lengths = attention_mask[rows, :prompt_width].sum(1)
        units = prompt_units(prompt_of, prompt_lengths, lengths - prompt_lengths, budget)
        unit_lengths = torch.tensor([int(prompt_lengths[u[0]] + (lengths[u] - prompt_lengths[u]).sum()) for u in units])
        batches = [
            torch.cat([units[i] for i in group.tolist()]) for group in token_budget_micro_batches(unit_lengths, budget)
        ]
        return MicroBatches([rows[batch.sort().values] for batch in batches], packed=True)
    if max_tokens == AUTO:
        padded_tokens = sum(
            padded_pass_tokens(input_ids[group, :prompt_width], attention_mask[group], prompt_width) for group in padded
        )
        if int(lengths.sum()) > PACKED_TOKENS_PER_PADDED_TOKEN * padded_tokens:
            return MicroBatches(padded, packed=False)
        max_tokens = micro_batch_size * int(lengths.max())
    return MicroBatches([rows[group] for group in token_budget_micro_batches(lengths, max_tokens)], packed=True)


def prompt_units(prompt_of: torch.Tensor, prompt_lengths: torch.Tensor, completion_lengths: torch.Tensor, budget: int):
    """The rows of each distinct prompt (``prompt_of``, (B,)), in runs whose prompt and completions fit ``budget``
    tokens (a run of one row may not): the units a shared-prompt plan keeps together."""
    units = []
    for prompt in torch.unique(prompt_of).tolist():
        rows = (prompt_of == prompt).nonzero().flatten().tolist()
        tokens, run = int(prompt_lengths[rows[0]]), []
        for row in rows:
            if run and tokens + int(completion_lengths[row]) > budget:
                units.append(torch.tensor(run))
                tokens, run = int(prompt_lengths[row]), []
            run.append(row)
            tokens += int(completion_lengths[row])
        units.append(torch.tensor(run))
    return units


def padded_pass_tokens(prompt_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int) -> int:
    """Tokens one padded pass over these rows computes: each distinct prompt once to the widest prompt, every row
    to the longest completion."""
    prompt_real = attention_mask[:, :prompt_width].sum(1)
    completion_real = attention_mask[:, prompt_width:].sum(1)
    distinct = len(torch.unique(prompt_ids, dim=0))
    return distinct * int(prompt_real.max()) + len(prompt_ids) * int(completion_real.max())


def token_budget_micro_batches(lengths: torch.Tensor, budget: int) -> list[torch.Tensor]:
    """Indices into ``lengths`` (B,) grouped into as few micro-batches of at most ``budget`` tokens as a greedy
    split finds, with about the same tokens in each (the longest sequence first to the emptiest micro-batch); a
    sequence longer than the budget is a micro-batch of its own.

    >>> [m.tolist() for m in token_budget_micro_batches(torch.tensor([5, 2, 7, 3, 1]), 8)]
    [[2], [0, 4], [1, 3]]
    """
    sizes = lengths.tolist()  # one read of the tensor (a single device sync), not one per row
    alone = [[index] for index, tokens in enumerate(sizes) if tokens > budget]
    rest = sorted((i for i, tokens in enumerate(sizes) if tokens <= budget), key=lambda i: -sizes[i])
    count = -(-sum(sizes[i] for i in rest) // budget)
    while True:
        groups: list[list[int]] = [[] for _ in range(count)]
        loads = [0] * count
        for index in rest:
            emptiest = min(range(count), key=loads.__getitem__)
            groups[emptiest].append(index)
            loads[emptiest] += sizes[index]
        if max(loads, default=0) <= budget:
            break
        count += 1
    return [torch.tensor(sorted(group), dtype=torch.long) for group in alone + groups if group]
