"""Checking a fine-tuned model: its greedy completions of rendered prompts with the project's sampler, and their
exact-match accuracy on (prompt, completion) pairs."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from unipg.learn.sft import require_pad_token
from unipg.policy.lm import LMPolicy


@torch.no_grad()
def greedy_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    batch_size: int = 128,
    max_new_tokens: int = 16,
) -> list[str]:
    """Greedy continuation of each rendered prompt, cut at the first EOS, special tokens dropped, stripped.

    Uses the project's sampler (``LMPolicy.sample`` at temperature 0), which left-pads from the ids, so the
    tokenizer's own ``padding_side`` is never changed.
    """
    require_pad_token(tokenizer)
    was_training = model.training
    policy = LMPolicy(model.eval(), tokenizer)
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    completions: list[str] = []
    for first in range(0, len(prompt_ids), batch_size):
        generation = policy.sample(
            prompt_ids[first : first + batch_size], max_new_tokens=max_new_tokens, temperature=0.0
        )
        completions += [text.strip() for text in generation.texts]
    model.train(was_training)
    return completions


def sft_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    pairs: list[tuple[str, str]],
    *,
    batch_size: int = 128,
    max_new_tokens: int = 16,
) -> float:
    """Fraction of (rendered prompt, completion) pairs whose greedy completion equals the expected one.

    Both sides are compared stripped of surrounding whitespace. A quick exact-match check for tests and the
    warm start, not a sampler.
    """
    if not pairs:
        raise ValueError("sft_accuracy needs at least one (prompt, completion) pair")
    completions = greedy_completions(
        model, tokenizer, [prompt for prompt, _ in pairs], batch_size=batch_size, max_new_tokens=max_new_tokens
    )
    matches = sum(completion == expected.strip() for completion, (_, expected) in zip(completions, pairs))
    return matches / len(pairs)
