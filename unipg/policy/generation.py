"""Sampling from a language-model policy: batched generation with a KV cache that returns each sampled token's
behaviour log-prob log μ(a_t|s_t), so the learner needs no second forward pass to know μ.

Temperature: log-probs are those of softmax(logits / temperature), the distribution tokens are drawn from;
top-k / top-p truncation is not reflected in them (as in vLLM and TRL). A ``LogitsConstraint`` (a grammar, e.g.
``unipg.inference.structured.RowGrammars``) is reflected: it masks the logits of its rows before the draw, so their
log-probs are those of the masked distribution, the one their tokens were drawn from. Every per-token tensor is
(B, C), C the completion length, with ``completion_mask`` 1 on sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from unipg.policy.forward import (
    cache_keyword,
    left_pad,
    new_cache,
    plain_cache,
    positions,
    prefill,
    scaled_logits,
)

# Finished rows leave the batch and the KV cache once they are a 1/COMPACT_WHEN_FINISHED share of the running ones:
# each removal copies the cache once, and a removed row no longer costs its share of every later step (at most
# about log(B)/log(4/3) copies in a batch of B rows).
COMPACT_WHEN_FINISHED = 4


@dataclass
class Generation:
    """What one batched sampling call produced; B = number of prompts."""

    prompt_ids: torch.Tensor  # (B, P) left-padded prompt token ids
    prompt_mask: torch.Tensor  # (B, P) 1 on prompt tokens, 0 on left padding
    completion_ids: torch.Tensor  # (B, C) sampled token ids, right-padded with the pad id
    completion_mask: torch.Tensor  # (B, C) 1 on sampled tokens (the stop token included), 0 on padding
    behaviour_logprobs: torch.Tensor  # (B, C) log μ(a_t|s_t) of each sampled token, 0 on padding
    texts: list[str]  # decoded completions, cut before a stop string, special tokens removed
    finish_reasons: list[str]  # "stop" (EOS or a stop string) or "length" (max_new_tokens reached)

    @property
    def completion_lengths(self) -> torch.Tensor:  # (B,)
        return self.completion_mask.sum(-1)


class SamplingPolicy(Protocol):
    """What generation reads of a policy (``unipg.policy.lm.LMPolicy`` is one)."""

    model: nn.Module
    tokenizer: object
    pad_id: int
    eos_ids: list[int]  # the token ids that end a completion
    context_length: int | None  # the model's positions; None: the model does not say
    share_prompts: bool  # run each distinct prompt once in the prefill

    @property
    def device(self) -> torch.device: ...

    def decode(self, ids: list[int]) -> str: ...


class LogitsConstraint(Protocol):
    """Which tokens each row may draw next (rows it does not constrain: any)."""

    def mask(self, logits: torch.Tensor, finished: torch.Tensor) -> torch.Tensor:
        """``logits`` (B, V) with the tokens an unfinished row (``finished`` (B,) False) may not draw at -inf."""

    def advance(self, tokens: torch.Tensor, finished: torch.Tensor) -> None:
        """The tokens (B,) drawn from the masked logits; ``finished`` (B,) as ``mask`` was given it."""


def _filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Mask logits outside the top-k tokens and outside the smallest set with probability ≥ top_p."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        remove = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the token crossing top_p
        remove[:, 0] = False  # and the likeliest, always: a top_p below float32's smallest number is 0 here
        logits = logits.masked_fill(torch.zeros_like(remove).scatter(-1, order, remove), float("-inf"))
    return logits


def draw_next(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token of every row, drawn from softmax(logits / temperature) restricted to the top-k/top-p
    tokens (the argmax when ``temperature`` is 0), and the log-probs (B, V) of the unrestricted distribution:
    those of the behaviour policy, whose ratio to the learner's the estimators take."""
    scaled = scaled_logits(logits, temperature)
    log_dist = torch.log_softmax(scaled, dim=-1)
    if temperature <= 0:
        return scaled.argmax(-1), log_dist
    probs = torch.softmax(_filter_logits(scaled, top_k, top_p), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1), log_dist


def on_device(generator: torch.Generator | None, device: torch.device) -> torch.Generator | None:
    """A generator that draws on ``device``: ``generator`` itself when it is there, else one seeded from it (which
    advances it by one draw), so a run keeps one CPU generator, checkpointed and restored, whatever the device."""
    if generator is None or generator.device.type == device.type:
        return generator
    seed = int(torch.randint(2**62, (1,), generator=generator))
    return torch.Generator(device).manual_seed(seed)


def cut_at_stop(text: str, stop: list[str] | None, keep: tuple[str, ...] = ()) -> str:
    """``text`` up to its earliest stop string: cut before it, or after it if the stop string is in ``keep``."""
    found = [(index, s) for s in stop or [] if (index := text.find(s)) >= 0]
    if not found:
        return text
    index, matched = min(found)
    return text[: index + len(matched)] if matched in keep else text[:index]


@torch.no_grad()
def generate(
    policy: SamplingPolicy,
    prompt_ids: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float | None = None,
    top_k: int | None = None,
    stop: list[str] | None = None,
    keep_stop: tuple[str, ...] = (),
    generator: torch.Generator | None = None,
    constraint: LogitsConstraint | None = None,
) -> Generation:
    """Sample one completion per prompt (temperature 0 = greedy), with a KV cache.

    Generation of a row ends at an EOS token, at a stop string, after ``max_new_tokens``, or when its
    prompt and completion fill the model's context (finish reason "length" then too, as inference servers
    do); a prompt that fills the context by itself is an error. The batch ends when every row has. A row's
    text is cut before the stop string it ended on, or after it for stop strings in ``keep_stop`` (a tool
    call's closing tag belongs to the call). Behaviour log-probs are those of softmax(logits / temperature)
    (of softmax(logits) when greedy), masked by ``constraint``: a row it constrains draws only what it allows.
    """
    if not prompt_ids or any(len(ids) == 0 for ids in prompt_ids):
        raise ValueError("every prompt must have at least one token")
    room = _room(policy, prompt_ids, max_new_tokens)
    generator = on_device(generator, policy.device)
    ids, prompt_mask = left_pad(prompt_ids, policy.pad_id)
    ids, prompt_mask = ids.to(policy.device), prompt_mask.to(policy.device)
    batch = ids.shape[0]
    cache, pos, mask = new_cache(policy.model), positions(prompt_mask), prompt_mask
    logits, _ = prefill(policy.model, ids, mask, cache, share=policy.share_prompts)
    eos = torch.tensor(policy.eos_ids, dtype=torch.long, device=policy.device)
    pad = torch.full((batch,), policy.pad_id, dtype=torch.long, device=policy.device)
    finished = torch.zeros(batch, dtype=torch.bool, device=policy.device)
    cut = torch.zeros(batch, dtype=torch.bool, device=policy.device)  # rows ended by a full context
    running = torch.arange(batch, device=policy.device)  # the rows the model still computes, in cache order
    compact = plain_cache(cache)
    stopped_by_string = [False] * batch
    tokens, logprobs, alive = [], [], []
    for step in range(max_new_tokens):
        logits = logits.float()
        if len(running) < batch:  # rows dropped from the batch draw too, so the generator advances as before
            logits = logits.new_zeros((batch, logits.shape[-1])).index_put((running,), logits)
        logits = constraint.mask(logits, finished) if constraint is not None else logits
        token, log_dist = draw_next(logits, temperature, top_k, top_p, generator)
        token = torch.where(finished, pad, token)
        if constraint is not None:
            constraint.advance(token, finished)
        tokens.append(token)
        logprobs.append(log_dist.gather(-1, token[:, None]).squeeze(-1))
        alive.append(~finished)
        finished = finished | torch.isin(token, eos)
        if stop:
            finished = _apply_stop_strings(policy.tokenizer, torch.stack(tokens, 1), finished, stop, stopped_by_string)
        at_limit = ~finished & (room <= step + 1)
        cut, finished = cut | at_limit, finished | at_limit
        if bool(finished.all()) or step == max_new_tokens - 1:
            break
        logits, running, mask, pos = _decode_step(policy, cache, token, finished, running, mask, pos, compact)
    return _generation(policy, ids, prompt_mask, tokens, logprobs, alive, finished, cut, stop, keep_stop)


def _generation(
    policy: SamplingPolicy,
    ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    tokens: list[torch.Tensor],
    logprobs: list[torch.Tensor],
    alive: list[torch.Tensor],
    finished: torch.Tensor,
    cut: torch.Tensor,
    stop: list[str] | None,
    keep_stop: tuple[str, ...],
) -> Generation:
    """The ``Generation`` of the decoding loop's per-step (B,) tokens, log-probs and alive flags; a row's finish
    reason is "stop" if it ``finished`` other than by a full context (``cut``), else "length"."""
    completion_ids = torch.stack(tokens, 1)
    completion_mask = torch.stack(alive, 1).long()
    behaviour = torch.stack(logprobs, 1) * completion_mask
    texts = _decode(policy, completion_ids, completion_mask, stop, keep_stop)
    reasons = ["stop" if finished[row] and not cut[row] else "length" for row in range(ids.shape[0])]
    return Generation(
        ids.cpu(), prompt_mask.cpu(), completion_ids.cpu(), completion_mask.cpu(), behaviour.cpu(), texts, reasons
    )


def _decode_step(
    policy: SamplingPolicy,
    cache,
    token: torch.Tensor,
    finished: torch.Tensor,
    running: torch.Tensor,
    mask: torch.Tensor,
    pos: torch.Tensor,
    compact: bool,
):
    """Feed the ``running`` rows (batch rows, in cache order) their new ``token``; the next logits, and the
    running rows, attention mask and positions after it. When a quarter of the running rows have finished
    (``COMPACT_WHEN_FINISHED``) and the cache allows it (``compact``), the finished rows are dropped from the cache
    and the batch first, with the left padding only they needed."""
    still = ~finished[running]
    done = len(running) - int(still.sum())
    if compact and done and done * COMPACT_WHEN_FINISHED >= len(running):
        keep = still.nonzero().squeeze(-1)
        cache.batch_select_indices(keep)
        running, mask, pos = running[keep], mask[keep], pos[keep]
        mask = _trim_left_padding(cache, mask)
    mask = torch.cat([mask, mask.new_ones((len(running), 1))], dim=-1)
    pos = pos[:, -1:] + 1
    if policy.context_length is not None:  # finished rows are fed padding; keep their positions valid
        pos = pos.clamp(max=policy.context_length - 1)
    logits = policy.model(
        input_ids=token[running][:, None],
        attention_mask=mask,
        position_ids=pos,
        use_cache=True,
        **{cache_keyword(policy.model): cache},
    ).logits[:, -1]
    return logits, running, mask, pos


def _trim_left_padding(cache, mask: torch.Tensor) -> torch.Tensor:
    """Drop the leading cache columns that no remaining row attends to (the left padding of longer prompts whose
    rows have left the batch); returns the attention mask without them. Positions are per row, so unchanged."""
    lead = int(mask.any(0).long().argmax())
    if lead == 0:
        return mask
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]
    return mask[:, lead:]


def _room(policy: SamplingPolicy, prompt_ids: list[list[int]], max_new_tokens: int) -> torch.Tensor:
    """(B,) how many tokens each row may generate: ``max_new_tokens``, or less where the context ends first."""
    lengths = torch.tensor([len(ids) for ids in prompt_ids], device=policy.device)
    if policy.context_length is None:
        return torch.full_like(lengths, max_new_tokens)
    longest = int(lengths.max())
    if longest >= policy.context_length:
        raise ValueError(
            f"a prompt of {longest} tokens leaves no room for a completion in the model's {policy.context_length}-"
            f"token context; lower sample.max_prompt_length below {policy.context_length} (longer prompts keep "
            "their last max_prompt_length tokens) and, for multi-turn tasks, agent.max_total_tokens"
        )
    return (policy.context_length - lengths).clamp(max=max_new_tokens)


def _apply_stop_strings(
    tokenizer, completion_ids: torch.Tensor, finished: torch.Tensor, stop: list[str], stopped: list[bool]
) -> torch.Tensor:
    longest = max(len(s) for s in stop) + 8  # a token spans at least one character
    for row in (~finished).nonzero().flatten().tolist():
        tail = tokenizer.decode(completion_ids[row, -longest:].tolist(), skip_special_tokens=True)
        if any(s in tail for s in stop):
            finished[row] = True
            stopped[row] = True
    return finished


def _decode(
    policy: SamplingPolicy,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    stop: list[str] | None,
    keep_stop: tuple[str, ...] = (),
) -> list[str]:
    return [
        cut_at_stop(policy.decode(completion_ids[row, : int(completion_mask[row].sum())].tolist()), stop, keep_stop)
        for row in range(completion_ids.shape[0])
    ]
