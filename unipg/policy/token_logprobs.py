"""Per-token log-probs, entropy and Σπ² of a causal LM's next-token distribution, computed from its final hidden
states a chunk of tokens at a time, so that the (tokens, vocabulary) float32 logits are never held whole.

At a real vocabulary (151,936 tokens for Qwen2.5) the logits of a micro-batch are the largest tensor of a learner
step: 16k completion tokens make 9.7 GB in float32, and a log-softmax and its gradient as much again each. Here
the lm_head runs over ``chunk_tokens`` hidden states at a time, each chunk's statistics are taken, and the chunk's
logits are dropped; in a differentiable pass each chunk is an activation checkpoint, so its logits are computed
again in the backward pass instead of being kept: the memory of the logits is that of one chunk, forward and
backward, at the cost of running the lm_head twice.

A model's logits are read as ``LogitHead``: its output layer applied to its decoder's last hidden state, then
the final scaling or soft cap some architectures apply (``logit_head`` says which are recognised). A model whose
logits cannot be read that way keeps its own: ``IDENTITY_HEAD`` then treats the logits it returns as the hidden
states, so the same chunked statistics run over them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from unipg.estimate.losses import entropy_from_logits
from unipg.estimate.token_baselines import sum_of_squared_probabilities
from unipg.policy.forward import scaled_logits


@dataclass(frozen=True)
class LogitHead:
    """A model's logits as a function of its decoder's last hidden state: z = s · linear(h), then
    z → c · tanh(z / c) with a soft cap c."""

    linear: nn.Module  # (n, H) → (n, V): the output layer (lm_head), called as a module so that wrappers apply
    scale: float = 1.0  # s: Cohere's logit_scale, or 1 / Granite's logits_scaling
    softcap: float | None = None  # c: Gemma 2 and 3's final_logit_softcapping; None: no cap

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.linear(hidden)
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


# For a model that computes its own logits: they stand in for the hidden states and pass through unchanged.
IDENTITY_HEAD = LogitHead(nn.Identity())


# Config settings with which transformers architectures change their logits otherwise (Falcon-H1's multiplier,
# RecurrentGemma's cap, MuseGlimmer's multiplier, Inkling's cut of a padded vocabulary): such models keep their own.
UNRECOGNISED_LOGIT_SETTINGS = ("lm_head_multiplier", "logits_soft_cap", "output_multiplier", "unpadded_vocab_size")


def logit_head(model: nn.Module) -> LogitHead | None:
    """The ``LogitHead`` of a Hugging Face causal LM (LoRA-wrapped or not), or None when its logits are not one.

    Recognised: the output layer (``get_output_embeddings``) on the decoder's output (``get_decoder``), times
    ``logit_scale`` (Cohere) or divided by ``logits_scaling`` (Granite), soft-capped by ``final_logit_softcapping``
    (Gemma 2, 3). None, and the caller computes the model's own logits, for a model without a separate decoder
    and output layer, for one whose config sets one of ``UNRECOGNISED_LOGIT_SETTINGS``, and for a model whose
    code comes with its checkpoint (``trust_remote_code``): its forward may change the logits in ways its config
    does not name.
    """
    linear = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if linear is None or decoder is None or decoder is model or _remote_code(model):
        return None
    config = model.config.get_text_config()
    if any(getattr(config, setting, None) is not None for setting in UNRECOGNISED_LOGIT_SETTINGS):
        return None
    scale = getattr(config, "logit_scale", None) or 1.0
    scaling = getattr(config, "logits_scaling", None)
    if scaling:
        scale = scale / scaling
    return LogitHead(linear, float(scale), getattr(config, "final_logit_softcapping", None))


def _remote_code(model: nn.Module) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under a LoRA wrapper
    # FSDP2's fully_shard swaps the class for a subclass of its own; the architecture is the first class past it
    architecture = next(cls for cls in type(base).__mro__ if not cls.__module__.startswith("torch."))
    return not architecture.__module__.startswith("transformers.")


@dataclass
class TokenStatistics:
    """Statistics of the next-token distribution π = softmax(logits / temperature) at each position, each shaped
    like the targets (...); those not asked for are None."""

    logprobs: torch.Tensor  # (...) log π(target_t | s_t), differentiable
    entropy: torch.Tensor | None = None  # (...) H[π(·|s_t)], differentiable only with entropy_grad
    sum_pi_squared: torch.Tensor | None = None  # (...) Σ_v π(v|s_t)², no gradient


def token_statistics(
    hidden: torch.Tensor,
    head: LogitHead,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    with_sum_pi_squared: bool = False,
) -> TokenStatistics:
    """Statistics of π = softmax(head(hidden) / temperature) at each position of ``hidden`` (..., H), read
    ``chunk_tokens`` positions at a time (None: all at once); ``targets`` (...) the tokens whose log-probs are
    taken, and the shape of every statistic.

    The logits are float32 and divided by the temperature as the sampler divides them (``scaled_logits``); a
    chunk's logits live only while its statistics are taken, and while gradients are recorded and there is more
    than one chunk, each is recomputed in the backward pass, so no more than one chunk's logits are held at any
    time. Gradients reach ``hidden`` and the head's weights as those of the whole (N, V) computation do.
    """
    wanted = (with_entropy, entropy_grad, with_sum_pi_squared)
    flat_hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    step = chunk_tokens or max(len(flat_targets), 1)
    # one chunk holds no more logits than the whole: recomputing it in the backward pass would save nothing
    recompute = torch.is_grad_enabled() and len(flat_targets) > step
    pieces = []
    for start in range(0, max(len(flat_targets), 1), step):  # no positions: one empty chunk
        chunk = (flat_hidden[start : start + step], flat_targets[start : start + step])
        if recompute:
            pieces.append(checkpoint(_chunk, *chunk, head, temperature, *wanted, use_reentrant=False))
        else:
            pieces.append(_chunk(*chunk, head, temperature, *wanted))
    logprobs, entropy, sum_pi_squared = (torch.cat(column) for column in zip(*pieces))
    shaped = lambda statistic, asked: statistic.view(targets.shape) if asked else None
    return TokenStatistics(
        logprobs=logprobs.view(targets.shape),
        entropy=shaped(entropy, with_entropy),
        sum_pi_squared=shaped(sum_pi_squared, with_sum_pi_squared),
    )


def _chunk(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: LogitHead,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
    with_sum_pi_squared: bool,
) -> tuple[torch.Tensor, ...]:
    """(log-probs, entropy, Σπ²) of one chunk; a statistic not asked for is an empty tensor."""
    logits = scaled_logits(head(hidden), temperature)
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    unasked = logprobs.new_empty(0)
    detached = logits.detach()
    entropy = entropy_from_logits(logits if entropy_grad else detached) if with_entropy else unasked
    sum_pi_squared = sum_of_squared_probabilities(detached) if with_sum_pi_squared else unasked
    return logprobs, entropy, sum_pi_squared
