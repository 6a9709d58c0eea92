"""A token-level language-model policy over any Hugging Face causal LM.

The policy π_θ(a_t | s_t) is the LM's next-token distribution: the state is the prompt plus the tokens
generated so far, the action the next token. This module answers Q1 for text:

- ``sample``: batched generation with a KV cache that returns each sampled token's behaviour log-prob
  log μ(a_t|s_t), so the learner needs no second forward pass to know μ (the loop is
  ``unipg.policy.generation.generate``);
- ``evaluate``: per-token log-probs (and entropy, and values) of given completions, recomputed by the
  training forward pass; at temperature 1 they equal the sampling-time log-probs up to float error;
- an optional value head (critic) on the backbone's last hidden state, or a separate critic model;
- a frozen reference model for the KL penalty: a copy, or with LoRA the same weights with the adapter
  disabled, so no second copy is held.

Layout: prompts are left-padded and completions right-padded, so every completion starts at the same
column and only the completion span is kept (``logits_to_keep``; the forward passes are in
``unipg.policy.forward``). Every per-token tensor of this module is (B, C), C the completion length, with
``completion_mask`` 1 on sampled tokens.

Log-probs, entropy and Σπ² are taken from the final hidden states a chunk of tokens at a time
(``logits_chunk_tokens``, ``unipg.policy.token_logprobs``), so the (tokens, vocabulary) logits are never held
whole; a critic's forward computes no logits at all.

Temperature: log-probs are those of softmax(logits / temperature), the distribution tokens are drawn
from; top-k / top-p truncation is not reflected in them (as in vLLM and TRL).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from unipg.policy.forward import (  # noqa: F401  (left_pad re-exported)
    completion_forward,
    context_length,
    left_pad,
    recomputing,
)
from unipg.policy.generation import (  # noqa: F401  (cut_at_stop re-exported)
    Generation,
    LogitsConstraint,
    cut_at_stop,
    generate,
)
from unipg.policy.packed import pack_rows, packed_forward, packed_hidden
from unipg.policy.segment_attention import use_segment_attention
from unipg.policy.token_logprobs import IDENTITY_HEAD, LogitHead, TokenStatistics, logit_head, token_statistics

VALUE_HEAD_FILE = "value_head.pt"


@dataclass
class Evaluation:
    """Per-token quantities of given completions under the current weights."""

    logprobs: torch.Tensor  # (B, C) log π_θ(a_t|s_t)
    entropy: torch.Tensor | None = None  # (B, C) H[π_θ(·|s_t)]
    values: torch.Tensor | None = None  # (B, C) V_φ(s_t), the value of the state before token t


@dataclass
class CompletionStates:
    """One forward pass over the completion tokens, padded (B, C, ...) or packed (M, ...)."""

    head_inputs: torch.Tensor  # (..., H) what ``head`` turns into logits: the last hidden states, or the logits
    head: LogitHead  # the model's ``logit_head``, or ``IDENTITY_HEAD`` over logits the model computed itself
    hidden: torch.Tensor | None  # (..., H) the last hidden state before each token (a value head's input), or None
    targets: torch.Tensor  # (...) long, the completion tokens
    layout: Callable[[torch.Tensor], torch.Tensor]  # per-token values of this form → (B, C)


class ValueHead(nn.Module):
    """V(s_t) = w·h_t + b on the backbone's last hidden state h_t (Ziegler et al. 2019)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.linear.weight, std=1.0 / (hidden_size + 1))
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (B, T, H) → (B, T)
        return self.linear(hidden.to(self.linear.weight.dtype)).squeeze(-1)


class LMPolicy(nn.Module):
    """π_θ over a causal LM, with an optional value head or critic model and an optional reference."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        *,
        value_head: bool = False,
        critic: nn.Module | None = None,
        reference: str = "none",
    ):
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
        # Set by the learner. packed: evaluation passes pack the rows into one padding-free row
        # (unipg.policy.packed); logits_chunk_tokens: log-probs, entropy and Σπ² are computed from the hidden
        # states this many tokens at a time, recomputed in the backward pass (token_statistics); None: all at once.
        self.packed = False
        self.logits_chunk_tokens: int | None = None
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

    def shares_packed_prompts(self) -> bool:
        """Whether packed passes can run each distinct prompt once (``unipg.policy.packed``): the model, and a
        separate critic, attend segment by segment."""
        models = [self.model] + ([self.critic.backbone] if self.critic is not None else [])
        return all(use_segment_attention(model) for model in models)

    @property
    def has_reference(self) -> bool:
        return self.reference_mode != "none"

    @property
    def reference_model(self) -> nn.Module | None:
        """The reference's own frozen copy (reference 'copy'), or None: no reference, or with LoRA the base weights
        under the adapter, which are the policy's too."""
        return self._reference

    def actor_parameters(self) -> list[nn.Parameter]:
        """The trainable weights of π_θ (with LoRA: the adapters only)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def critic_parameters(self) -> list[nn.Parameter]:
        """The value head, or the separate critic model; trained with the critic's learning rate."""
        modules = [m for m in (self.value_head, self.critic) if m is not None]
        return [p for module in modules for p in module.parameters() if p.requires_grad]

    # ------------------------------------------------------------------------------------------------
    # Generation

    def sample(
        self,
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
        """Sample one completion per prompt (temperature 0 = greedy), with a KV cache and the behaviour
        log-prob of every sampled token; ``unipg.policy.generation.generate`` says when a row ends and how
        ``constraint`` (a grammar of some rows) masks their draws."""
        return generate(
            self,
            prompt_ids,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop=stop,
            keep_stop=keep_stop,
            generator=generator,
            constraint=constraint,
        )

    def decode(self, ids: list[int]) -> str:
        """The text of sampled token ids, special tokens (EOS, chat markers) removed."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ------------------------------------------------------------------------------------------------
    # Log-probs, entropy, values of given completions

    def evaluate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        completion_length: int,
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
        entropy_grad: bool = False,
        with_values: bool = False,
    ) -> Evaluation:
        """Log π_θ of the last ``completion_length`` tokens of each row (and entropy, and values).

        ``input_ids`` / ``attention_mask`` (B, P + C) are left-padded prompts followed by right-padded
        completions. Differentiable (the entropy only with ``entropy_grad``, so that a pure metric costs no
        autograd memory); callers bound memory by passing micro-batches.
        """
        self._check_context(attention_mask)
        needs_hidden = with_values and self.value_head is not None
        states = self._states(self.model, input_ids, attention_mask, completion_length, hidden=needs_hidden)
        statistics = self._statistics(states, temperature, with_entropy=with_entropy, entropy_grad=entropy_grad)
        result = Evaluation(
            logprobs=states.layout(statistics.logprobs),
            entropy=None if statistics.entropy is None else states.layout(statistics.entropy),
        )
        if with_values:
            result.values = (
                states.layout(self.value_head(states.hidden))
                if needs_hidden
                else self.values(input_ids, attention_mask, completion_length)
            )
        return result

    def _states(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        completion_length: int,
        *,
        hidden: bool = False,
    ) -> CompletionStates:
        """One forward pass of ``model`` over the completion tokens, padded (B, C, ...) or packed (M, ...) per
        ``self.packed``: the lm_head's inputs (or, for a model whose logits are not a ``LogitHead``, its logits),
        and with ``hidden`` the last hidden states."""
        head = logit_head(model)
        with recomputing(model) as recomputed:
            if self.packed:
                share = self.share_prompts and use_segment_attention(model)
                packing = pack_rows(input_ids, attention_mask, completion_length, share_prompts=share)
                out = packed_forward(model, packing, logits=head is None, hidden=hidden or head is not None)
                targets, layout = packing.targets, packing.unpack
            else:
                out = completion_forward(
                    model,
                    input_ids,
                    attention_mask,
                    completion_length,
                    logits=head is None,
                    hidden=hidden or head is not None,
                    share_prompts=self.share_prompts and not recomputed,
                )
                targets, layout = input_ids[:, -completion_length:], _same
        if head is None:
            return CompletionStates(out.logits, IDENTITY_HEAD, out.hidden, targets, layout)
        return CompletionStates(out.hidden, head, out.hidden, targets, layout)

    def _statistics(self, states: CompletionStates, temperature: float, **wanted) -> TokenStatistics:
        """``token_statistics`` of the completion tokens, ``logits_chunk_tokens`` at a time."""
        return token_statistics(
            states.head_inputs,
            states.head,
            states.targets,
            temperature=temperature,
            chunk_tokens=self.logits_chunk_tokens,
            **wanted,
        )

    def _check_context(self, attention_mask: torch.Tensor) -> None:
        """A row longer than the model's context would reach it as an index error (learned positions)."""
        if self.context_length is None:
            return
        longest = int(attention_mask.sum(-1).max())
        if longest > self.context_length:
            raise ValueError(
                f"a sequence of {longest} tokens (prompt + completion) exceeds the model's "
                f"{self.context_length}-token context; lower sample.max_prompt_length or "
                "sample.max_new_tokens so that the two fit"
            )

    def values(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        completion_length: int,
        *,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """V(s_t) for each completion token t, (B, C): the value before the token is chosen."""
        if self.critic is not None:
            return self.critic(input_ids, attention_mask, completion_length, packed=self.packed)
        if self.value_head is None:
            raise ValueError("this policy has no critic; enable model.value_head or set model.critic")
        if hidden is not None:
            return self.value_head(hidden)
        states = self._states(self.model, input_ids, attention_mask, completion_length, hidden=True)
        return states.layout(self.value_head(states.hidden))

    @torch.no_grad()
    def reference_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int, *, temperature: float = 1.0
    ) -> torch.Tensor:
        """log π_ref of the completion tokens, (B, C), under the frozen reference model."""
        self._check_context(attention_mask)
        if self.reference_mode == "copy":
            model = self._reference
        elif self.reference_mode == "adapter":
            with self.model.disable_adapter():
                return self.evaluate(input_ids, attention_mask, completion_length, temperature=temperature).logprobs
        else:
            raise ValueError("this policy holds no reference model; set model.reference to 'copy' or use LoRA")
        states = self._states(model, input_ids, attention_mask, completion_length)
        return states.layout(self._statistics(states, temperature).logprobs)

    @torch.no_grad()
    def sum_pi_squared(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int, *, temperature: float = 1.0
    ) -> torch.Tensor:
        """Σ_v π_θ(v|s_t)² at each completion position, (B, C): how concentrated the policy's distribution is
        (the optimal token baseline's logit-gradient proxy, ``unipg.estimate.token_baselines``)."""
        self._check_context(attention_mask)
        states = self._states(self.model, input_ids, attention_mask, completion_length)
        return states.layout(self._statistics(states, temperature, with_sum_pi_squared=True).sum_pi_squared)

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
        (path / "unipg-policy.json").write_text(
            json.dumps({"value_head": self.value_head is not None, "critic": self.critic is not None})
        )
        return path


class CriticModel(nn.Module):
    """A separate critic: its own transformer backbone and a value head on its last hidden state."""

    def __init__(self, backbone: nn.Module, head: ValueHead | None = None):
        super().__init__()
        self.backbone = backbone
        self.head = head or ValueHead(backbone.config.get_text_config().hidden_size)
        self.share_prompts = True  # run each distinct prompt once per padded pass (see completion_forward)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_length: int, *, packed: bool = False
    ) -> torch.Tensor:
        """(B, C) values; ``packed``: one padding-free pass (unipg.policy.packed). Only the backbone's decoder
        runs: a value needs no logits."""
        decoder = self.backbone.get_decoder()
        if packed:
            share = self.share_prompts and use_segment_attention(decoder)
            packing = pack_rows(input_ids, attention_mask, completion_length, share_prompts=share)
            return packing.unpack(self.head(packed_hidden(decoder, packing)))
        out = completion_forward(
            decoder, input_ids, attention_mask, completion_length, share_prompts=self.share_prompts
        )
        return self.head(out.hidden)

    def save(self, path: Path) -> None:
        self.backbone.save_pretrained(path)
        torch.save(self.head.state_dict(), path / VALUE_HEAD_FILE)


def _same(values: torch.Tensor) -> torch.Tensor:
    return values
