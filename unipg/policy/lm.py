"""A token-level language-model policy over any Hugging Face causal LM.

The policy π_θ(a_t | s_t) is the LM's next-token distribution: the state is the prompt plus the tokens
generated so far, the action the next token. This module answers Q1 for text:

- ``sample``: batched generation with a KV cache that returns each sampled token's behaviour log-prob
  log μ(a_t|s_t), so the learner needs no second forward pass to know μ;
- ``evaluate``: per-token log-probs (and entropy, and values) of given completions, recomputed by the
  training forward pass; at temperature 1 they equal the sampling-time log-probs up to float error;
- an optional value head (critic) on the backbone's last hidden state, or a separate critic model;
- a frozen reference model for the KL penalty: a copy, or with LoRA the same weights with the adapter
  disabled, so no second copy is held.

Layout: prompts are left-padded and completions right-padded, so every completion starts at the same
column and the lm_head only runs over the completion span (``logits_to_keep``). Every per-token tensor
of this module is (B, C), C the completion length, with ``completion_mask`` 1 on sampled tokens.

Temperature: log-probs are those of softmax(logits / temperature), the distribution tokens are drawn
from; top-k / top-p truncation is not reflected in them (as in vLLM and TRL).
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from unipg.estimate.losses import entropy_from_logits

VALUE_HEAD_FILE = "value_head.pt"

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


@dataclass
class Evaluation:
    """Per-token quantities of given completions under the current weights."""

    logprobs: torch.Tensor  # (B, C) log π_θ(a_t|s_t)
    entropy: torch.Tensor | None = None  # (B, C) H[π_θ(·|s_t)]
    values: torch.Tensor | None = None  # (B, C) V_φ(s_t), the value of the state before token t


class ValueHead(nn.Module):
    """V(s_t) = w·h_t + b on the backbone's last hidden state h_t (Ziegler et al. 2019)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.linear.weight, std=1.0 / (hidden_size + 1))
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (B, T, H) → (B, T)
        return self.linear(hidden.to(self.linear.weight.dtype)).squeeze(-1)


def _cache_keyword(model: nn.Module) -> str:
    """Newer transformers name the KV-cache argument ``cache``; older ones ``past_key_values``."""
    return _cache_keyword_of(type(model))


@functools.cache
def _cache_keyword_of(model_class: type) -> str:  # signature inspection is slow; every forward asks
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _new_cache(model: nn.Module):
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
            ids[row, width - len(tokens):] = torch.tensor(tokens, dtype=torch.long)
            mask[row, width - len(tokens):] = 1
    return ids, mask


@dataclass
class CompletionForward:
    logits: torch.Tensor  # (B, C, V) the logits that predict each completion token
    hidden: torch.Tensor | None  # (B, C, H) last hidden state at the same positions (the state before token t)


def _plain_cache(cache) -> bool:
    """Prompt sharing needs a cache whose rows can be gathered: plain full-attention layers only."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers) and hasattr(cache, "batch_select_indices")


def completion_forward(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int,
                       *, hidden: bool = False, share_prompts: bool = True) -> CompletionForward:
    """Forward pass over prompts + completions that runs each distinct prompt once.

    The samples of a GRPO group share their prompt, so the prompt's keys and values are computed once per
    distinct prompt and gathered for every row, and only the completion tokens run per row (the prefix
    caching of inference engines, applied to the training and reference passes too). Gradients flow
    through the shared prompt states. Falls back to one plain forward when no prompt repeats or the
    model's cache cannot be gathered.
    """
    width = input_ids.shape[1] - completion_length
    cache = _new_cache(model) if share_prompts and width > 0 else None
    if cache is None or not _plain_cache(cache) or not _repeats(input_ids[:, :width]):
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions(attention_mask),
                    use_cache=False, logits_to_keep=completion_length + 1, output_hidden_states=hidden)
        return CompletionForward(out.logits[:, :-1], out.hidden_states[-1][:, -(completion_length + 1):-1] if hidden else None)
    first_logits, first_hidden = prefill(model, input_ids[:, :width], attention_mask[:, :width], cache, hidden=hidden)
    rest = model(input_ids=input_ids[:, width:], attention_mask=attention_mask,
                 position_ids=positions(attention_mask)[:, width:], use_cache=True, output_hidden_states=hidden,
                 **{_cache_keyword(model): cache})
    logits = torch.cat([first_logits[:, None], rest.logits[:, :-1]], dim=1)
    states = torch.cat([first_hidden[:, None], rest.hidden_states[-1][:, :-1]], dim=1) if hidden else None
    return CompletionForward(logits, states)


def _repeats(prompt_ids: torch.Tensor) -> bool:
    return len(torch.unique(prompt_ids, dim=0)) < len(prompt_ids)


def prefill(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, cache, *, share: bool = True,
            hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run left-padded prompts (B, P) into ``cache``; each distinct prompt once when ``share`` and the cache's
    rows can be gathered. Returns the last position's logits (B, V) and last hidden state (B, H) or None.
    """
    keyword = _cache_keyword(model)
    unique, inverse = torch.unique(prompt_ids, dim=0, return_inverse=True)
    if share and len(unique) < len(prompt_ids) and _plain_cache(cache):
        first = torch.zeros(len(unique), dtype=torch.long, device=prompt_ids.device)
        first.scatter_(0, inverse, torch.arange(len(inverse), device=prompt_ids.device))  # a row of each prompt
        prompt_ids, prompt_mask, rows = unique, prompt_mask[first], inverse
    else:
        rows = torch.arange(len(prompt_ids), device=prompt_ids.device)
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions(prompt_mask), use_cache=True,
                logits_to_keep=1, output_hidden_states=hidden, **{keyword: cache})
    if len(rows) > len(prompt_ids):
        cache.batch_select_indices(rows)
    return out.logits[rows, -1], out.hidden_states[-1][rows, -1] if hidden else None


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits in float32, divided by the sampling temperature (greedy, 0, keeps them as they are)."""
    logits = logits.float()
    return logits / temperature if temperature > 0 and temperature != 1.0 else logits


def _token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits) at the target tokens: (B, C, V), (B, C) → (B, C)."""
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)


def _filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Mask logits outside the top-k tokens and outside the smallest set with probability ≥ top_p."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        remove = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the token crossing top_p
        logits = logits.masked_fill(torch.zeros_like(remove).scatter(-1, order, remove), float("-inf"))
    return logits


def draw_next(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
              generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token of every row, drawn from softmax(logits / temperature) restricted to the top-k/top-p
    tokens (the argmax when ``temperature`` is 0), and the log-probs (B, V) of the unrestricted distribution:
    those of the behaviour policy, whose ratio to the learner's the estimators take."""
    scaled = _scaled(logits, temperature)
    log_dist = torch.log_softmax(scaled, dim=-1)
    if temperature <= 0:
        return scaled.argmax(-1), log_dist
    probs = torch.softmax(_filter_logits(scaled, top_k, top_p), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1), log_dist


def cut_at_stop(text: str, stop: list[str] | None, keep: tuple[str, ...] = ()) -> str:
    """``text`` up to its earliest stop string: cut before it, or after it if the stop string is in ``keep``."""
    found = [(index, s) for s in stop or [] if (index := text.find(s)) >= 0]
    if not found:
        return text
    index, matched = min(found)
    return text[: index + len(matched)] if matched in keep else text[:index]


class LMPolicy(nn.Module):
    """π_θ over a causal LM, with an optional value head or critic model and an optional reference."""

    def __init__(self, model: nn.Module, tokenizer, *, value_head: bool = False, critic: nn.Module | None = None,
                 reference: str = "none"):
        super().__init__()
        if reference not in ("none", "copy", "adapter"):
            raise ValueError(f"reference must be 'none', 'copy' or 'adapter', got '{reference}'")
        self.model, self.tokenizer = model, tokenizer
        hidden_size = model.config.get_text_config().hidden_size
        self.value_head = ValueHead(hidden_size) if value_head and critic is None else None
        self.critic = critic  # a separate ``CriticModel``, trained beside the policy
        self.reference_mode = reference
        self._reference = copy.deepcopy(model).eval().requires_grad_(False) if reference == "copy" else None
        self.share_prompts = True  # run each distinct prompt once per forward pass (see completion_forward)
        self.pad_id = tokenizer.pad_token_id
        self.eos_ids = self._eos_ids()
        self.context_length = context_length(model)  # None: the model does not say; nothing is cut

    def _eos_ids(self) -> list[int]:
        ids = {self.tokenizer.eos_token_id}
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        ids |= set(eos) if isinstance(eos, (list, tuple)) else {eos}
        return sorted(i for i in ids if i is not None)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def has_critic(self) -> bool:
        return self.value_head is not None or self.critic is not None

    @property
    def has_reference(self) -> bool:
        return self.reference_mode != "none"

    def actor_parameters(self) -> list[nn.Parameter]:
        """The trainable weights of π_θ (with LoRA: the adapters only)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def critic_parameters(self) -> list[nn.Parameter]:
        """The value head, or the separate critic model; trained with the critic's learning rate."""
        modules = [m for m in (self.value_head, self.critic) if m is not None]
        return [p for module in modules for p in module.parameters() if p.requires_grad]

    # ------------------------------------------------------------------------------------------------
    # Generation

    @torch.no_grad()
    def sample(self, prompt_ids: list[list[int]], *, max_new_tokens: int, temperature: float = 1.0,
               top_p: float | None = None, top_k: int | None = None, stop: list[str] | None = None,
               keep_stop: tuple[str, ...] = (), generator: torch.Generator | None = None) -> Generation:
        """Sample one completion per prompt (temperature 0 = greedy), with a KV cache.

        Generation of a row ends at an EOS token, at a stop string, after ``max_new_tokens``, or when its
        prompt and completion fill the model's context (finish reason "length" then too, as inference servers
        do); a prompt that fills the context by itself is an error. The batch ends when every row has. A row's
        text is cut before the stop string it ended on, or after it for stop strings in ``keep_stop`` (a tool
        call's closing tag belongs to the call). Behaviour log-probs are those of softmax(logits / temperature)
        (of softmax(logits) when greedy).
        """
        if not prompt_ids or any(len(ids) == 0 for ids in prompt_ids):
            raise ValueError("every prompt must have at least one token")
        room = self._room(prompt_ids, max_new_tokens)
        ids, prompt_mask = left_pad(prompt_ids, self.pad_id)
        ids, prompt_mask = ids.to(self.device), prompt_mask.to(self.device)
        batch = ids.shape[0]
        cache, pos, mask = _new_cache(self.model), positions(prompt_mask), prompt_mask
        logits, _ = prefill(self.model, ids, mask, cache, share=self.share_prompts)
        eos = torch.tensor(self.eos_ids, dtype=torch.long, device=self.device)
        pad = torch.full((batch,), self.pad_id, dtype=torch.long, device=self.device)
        finished = torch.zeros(batch, dtype=torch.bool, device=self.device)
        cut = torch.zeros(batch, dtype=torch.bool, device=self.device)  # rows ended by a full context
        running = torch.arange(batch, device=self.device)  # the rows the model still computes, in cache order
        compact = _plain_cache(cache)
        stopped_by_string = [False] * batch
        tokens, logprobs, alive = [], [], []
        for step in range(max_new_tokens):
            logits = logits.float()
            if len(running) < batch:  # rows dropped from the batch draw too, so the generator advances as before
                logits = logits.new_zeros((batch, logits.shape[-1])).index_put((running,), logits)
            token, log_dist = draw_next(logits, temperature, top_k, top_p, generator)
            token = torch.where(finished, pad, token)
            tokens.append(token)
            logprobs.append(log_dist.gather(-1, token[:, None]).squeeze(-1))
            alive.append(~finished)
            finished = finished | torch.isin(token, eos)
            if stop:
                finished = self._apply_stop_strings(torch.stack(tokens, 1), finished, stop, stopped_by_string)
            at_limit = ~finished & (room <= step + 1)
            cut, finished = cut | at_limit, finished | at_limit
            if bool(finished.all()) or step == max_new_tokens - 1:
                break
            logits, running, mask, pos = self._decode_step(cache, token, finished, running, mask, pos, compact)
        completion_ids = torch.stack(tokens, 1)
        completion_mask = torch.stack(alive, 1).long()
        behaviour = torch.stack(logprobs, 1) * completion_mask
        texts = self._decode(completion_ids, completion_mask, stop, keep_stop)
        reasons = ["stop" if finished[row] and not cut[row] else "length" for row in range(batch)]
        return Generation(ids.cpu(), prompt_mask.cpu(), completion_ids.cpu(), completion_mask.cpu(), behaviour.cpu(),
                          texts, reasons)

    def _decode_step(self, cache, token: torch.Tensor, finished: torch.Tensor, running: torch.Tensor,
                     mask: torch.Tensor, pos: torch.Tensor, compact: bool):
        """Feed the ``running`` rows (batch rows, in cache order) their new ``token``; the next logits, and the
        running rows, attention mask and positions after it. When most rows have finished (one runaway row would
        otherwise keep the whole batch decoding) and the cache allows it (``compact``), the finished rows are
        dropped from the cache and the batch first."""
        still = ~finished[running]
        if compact and 2 * int(still.sum()) <= len(running):
            keep = still.nonzero().squeeze(-1)
            cache.batch_select_indices(keep)
            running, mask, pos = running[keep], mask[keep], pos[keep]
        mask = torch.cat([mask, mask.new_ones((len(running), 1))], dim=-1)
        pos = pos[:, -1:] + 1
        if self.context_length is not None:  # finished rows are fed padding; keep their positions valid
            pos = pos.clamp(max=self.context_length - 1)
        logits = self.model(input_ids=token[running][:, None], attention_mask=mask, position_ids=pos,
                            use_cache=True, **{_cache_keyword(self.model): cache}).logits[:, -1]
        return logits, running, mask, pos

    def _room(self, prompt_ids: list[list[int]], max_new_tokens: int) -> torch.Tensor:
        """(B,) how many tokens each row may generate: ``max_new_tokens``, or less where the context ends first."""
        lengths = torch.tensor([len(ids) for ids in prompt_ids], device=self.device)
        if self.context_length is None:
            return torch.full_like(lengths, max_new_tokens)
        longest = int(lengths.max())
        if longest >= self.context_length:
            raise ValueError(
                f"a prompt of {longest} tokens leaves no room for a completion in the model's {self.context_length}-"
                f"token context; lower sample.max_prompt_length below {self.context_length} (longer prompts keep "
                "their last max_prompt_length tokens) and, for multi-turn tasks, agent.max_total_tokens")
        return (self.context_length - lengths).clamp(max=max_new_tokens)

    def _apply_stop_strings(self, completion_ids: torch.Tensor, finished: torch.Tensor, stop: list[str],
                            stopped: list[bool]) -> torch.Tensor:
        longest = max(len(s) for s in stop) + 8  # a token spans at least one character
        for row in (~finished).nonzero().flatten().tolist():
            tail = self.tokenizer.decode(completion_ids[row, -longest:].tolist(), skip_special_tokens=True)
            if any(s in tail for s in stop):
                finished[row] = True
                stopped[row] = True
        return finished

    def _decode(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor, stop: list[str] | None,
                keep_stop: tuple[str, ...] = ()) -> list[str]:
        return [cut_at_stop(self.decode(completion_ids[row, : int(completion_mask[row].sum())].tolist()), stop,
                            keep_stop) for row in range(completion_ids.shape[0])]

    def decode(self, ids: list[int]) -> str:
        """The text of sampled token ids, special tokens (EOS, chat markers) removed."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ------------------------------------------------------------------------------------------------
    # Log-probs, entropy, values of given completions

    def evaluate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int, *,
                 temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = False,
                 with_values: bool = False) -> Evaluation:
        """Log π_θ of the last ``completion_length`` tokens of each row (and entropy, and values).

        ``input_ids`` / ``attention_mask`` (B, P + C) are left-padded prompts followed by right-padded
        completions. Differentiable (the entropy only with ``entropy_grad``, so that a pure metric costs no
        autograd memory); callers bound memory by passing micro-batches.
        """
        self._check_context(attention_mask)
        needs_hidden = with_values and self.value_head is not None
        out = completion_forward(self.model, input_ids, attention_mask, completion_length, hidden=needs_hidden,
                                 share_prompts=self.share_prompts)
        logits = _scaled(out.logits, temperature)
        result = Evaluation(logprobs=_token_logprobs(logits, input_ids[:, -completion_length:]))
        if with_entropy:
            result.entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
        if with_values:
            result.values = self.values(input_ids, attention_mask, completion_length, hidden=out.hidden)
        return result

    def _check_context(self, attention_mask: torch.Tensor) -> None:
        """A row longer than the model's context would reach it as an index error (learned positions)."""
        if self.context_length is None:
            return
        longest = int(attention_mask.sum(-1).max())
        if longest > self.context_length:
            raise ValueError(f"a sequence of {longest} tokens (prompt + completion) exceeds the model's "
                             f"{self.context_length}-token context; lower sample.max_prompt_length or "
                             "sample.max_new_tokens so that the two fit")

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int, *,
               hidden: torch.Tensor | None = None) -> torch.Tensor:
        """V(s_t) for each completion token t, (B, C): the value before the token is chosen."""
        if self.critic is not None:
            return self.critic(input_ids, attention_mask, completion_length)
        if self.value_head is None:
            raise ValueError("this policy has no critic; enable model.value_head or set model.critic")
        if hidden is None:
            hidden = completion_forward(self.model, input_ids, attention_mask, completion_length, hidden=True,
                                        share_prompts=self.share_prompts).hidden
        return self.value_head(hidden)

    @torch.no_grad()
    def reference_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int,
                           *, temperature: float = 1.0) -> torch.Tensor:
        """log π_ref of the completion tokens, (B, C), under the frozen reference model."""
        self._check_context(attention_mask)
        if self.reference_mode == "copy":
            model = self._reference
        elif self.reference_mode == "adapter":
            with self.model.disable_adapter():
                return self.evaluate(input_ids, attention_mask, completion_length, temperature=temperature).logprobs
        else:
            raise ValueError("this policy holds no reference model; set model.reference to 'copy' or use LoRA")
        logits = completion_forward(model, input_ids, attention_mask, completion_length,
                                    share_prompts=self.share_prompts).logits
        return _token_logprobs(_scaled(logits, temperature), input_ids[:, -completion_length:])

    # ------------------------------------------------------------------------------------------------
    # Persistence

    def save(self, path: str | Path) -> Path:
        """Save the LM and tokenizer with ``save_pretrained`` (loadable as a plain HF model), plus critic."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        if self.value_head is not None:
            torch.save(self.value_head.state_dict(), path / VALUE_HEAD_FILE)
        if self.critic is not None:
            self.critic.save(path / "critic")
        (path / "unipg-policy.json").write_text(json.dumps({"value_head": self.value_head is not None,
                                                            "critic": self.critic is not None}))
        return path


class CriticModel(nn.Module):
    """A separate critic: its own transformer backbone and a value head on its last hidden state."""

    def __init__(self, backbone: nn.Module, head: ValueHead | None = None):
        super().__init__()
        self.backbone = backbone
        self.head = head or ValueHead(backbone.config.get_text_config().hidden_size)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int) -> torch.Tensor:
        return self.head(completion_forward(self.backbone, input_ids, attention_mask, completion_length, hidden=True).hidden)

    def save(self, path: Path) -> None:
        self.backbone.save_pretrained(path)
        torch.save(self.head.state_dict(), path / VALUE_HEAD_FILE)
