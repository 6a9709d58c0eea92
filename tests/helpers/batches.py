"""Learner inputs: a sampled GRPO batch of the embedded model with its config, and a length-skewed batch of random
tokens with its config."""

import torch

from unipg.config import Config, load_config
from unipg.learn.lm_batch import LMBatch
from unipg.policy.forward import left_pad

GROUP = 4  # samples per prompt of ``make_batch``


def make_config(algorithm: str = "grpo", *overrides: str) -> Config:
    """One mini-batch of 16 completions (4 prompts × ``GROUP``) of at most 8 tokens, learning rate 1e-3."""
    return load_config(
        None,
        [
            "task.name=arithmetic",
            f"algorithm={algorithm}",
            "train.batch_size=16",
            "train.mini_batch_size=16",
            "train.micro_batch_size=16",
            f"sample.samples_per_prompt={GROUP}",
            "sample.max_new_tokens=8",
            "train.learning_rate=1e-3",
            *overrides,
        ],
    )


def make_batch(policy, seed: int = 0) -> LMBatch:
    """``GROUP`` completions of 4 addition prompts sampled from ``policy``, with made-up distinct scores."""
    tokenizer = policy.tokenizer
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{i}+{2 * i}="}], tokenize=False, add_generation_prompt=True
        )
        for i in range(7, 16, 2)
    ][:4]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts for _ in range(GROUP)]
    generation = policy.sample(ids, max_new_tokens=8, generator=torch.Generator().manual_seed(seed))
    scores = [float(i % 3 == 0) + 0.1 * i for i in range(len(ids))]
    return LMBatch.from_generation(generation, scores)


PROMPT_LENGTHS = (5, 9, 3, 7, 6, 4)
COMPLETION_LENGTHS = (30, 3, 7, 1, 12, 2)  # length-skewed, as agent trajectories are


def skewed_batch(seed: int = 0) -> LMBatch:
    """Rows of very different lengths: left-padded prompts, right-padded completions, a hole of inserted
    (loss-masked) tokens in the longest one, random behaviour log-probs and advantages."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(8, 90, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    prompt_ids, prompt_mask = left_pad(prompts, 0)
    width = max(COMPLETION_LENGTHS)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    real = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, length in enumerate(COMPLETION_LENGTHS):
        ids[row, :length] = torch.randint(8, 90, (length,), generator=generator)
        real[row, :length] = 1
    loss_mask = real.float()
    loss_mask[0, 10:15] = 0  # a tool observation inside the first trajectory
    batch = LMBatch(
        input_ids=torch.cat([prompt_ids, ids], 1),
        attention_mask=torch.cat([prompt_mask, real], 1),
        completion_mask=loss_mask,
        behaviour_logprobs=-torch.rand(loss_mask.shape, generator=generator) * 5 * loss_mask,
        scores=torch.rand(len(prompts), generator=generator),
    )
    batch.advantages = torch.randn(loss_mask.shape, generator=generator) * loss_mask
    batch.returns = torch.randn(loss_mask.shape, generator=generator) * loss_mask
    return batch


def skewed_config(*overrides: str) -> Config:
    """GRPO without a KL penalty on one mini-batch of ``skewed_batch``'s six rows (completions up to 30 tokens)."""
    return load_config(
        None,
        [
            "task.name=arithmetic",
            "algorithm=grpo",
            "train.batch_size=6",
            "train.mini_batch_size=6",
            "sample.samples_per_prompt=2",
            "sample.max_new_tokens=30",
            "estimator.kl_coef=0.0",
            *overrides,
        ],
    )
