"""Peak tensor memory of a learner's forward and backward pass of log-probs and entropy, the whole logits at once
against chunks of ``model.logits_chunk_tokens`` tokens (``unipg.policy.token_logprobs``).

    python benchmarks/logits_memory.py             # the figures in docs/benchmarks.md
    python benchmarks/logits_memory.py --smoke     # tiny sizes, seconds

The model is one small Qwen2 layer under Qwen2.5's vocabulary of 151,936 tokens (hidden size 64), so that the
logits dwarf everything else, as they do in a learner step of a small model; the batch is 4 rows of 256
completion tokens. The peak is measured on the CPU without timing: every storage an operator creates is counted
from its creation to the freeing of its last tensor (``tests.helpers.memory.PeakTensorBytes``), parameters
excluded, their gradients included. The figure is deterministic: it does not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tests.helpers.memory import PeakTensorBytes  # noqa: E402
from unipg.policy.embedded import build_tokenizer  # noqa: E402
from unipg.policy.lm import LMPolicy  # noqa: E402

FULL = {"vocabulary": 151_936, "hidden": 64, "rows": 4, "completion": 256, "chunks": (None, 1024, 512, 256, 64)}
SMOKE = {"vocabulary": 50_000, "hidden": 16, "rows": 2, "completion": 32, "chunks": (None, 16)}
PROMPT = 4  # tokens of every prompt
MB = 1e6


def policy_of(vocabulary: int, hidden: int) -> LMPolicy:
    from transformers import Qwen2Config, Qwen2ForCausalLM  # after unipg, which hides mismatched torch companions

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocabulary,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return LMPolicy(Qwen2ForCausalLM(config).eval(), build_tokenizer())


def peak_bytes(policy: LMPolicy, rows: int, completion: int, chunk_tokens: int | None) -> int:
    """Peak bytes alive during evaluate (log-probs and entropy, both differentiable) and its backward pass."""
    input_ids = torch.randint(8, 90, (rows, PROMPT + completion), generator=torch.Generator().manual_seed(0))
    policy.logits_chunk_tokens = chunk_tokens
    policy.model.zero_grad(set_to_none=True)
    with PeakTensorBytes() as memory:
        out = policy.evaluate(input_ids, torch.ones_like(input_ids), completion, with_entropy=True, entropy_grad=True)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        del out
    return memory.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    sizes = SMOKE if parser.parse_args().smoke else FULL
    policy = policy_of(sizes["vocabulary"], sizes["hidden"])
    tokens = sizes["rows"] * sizes["completion"]
    whole_logits = tokens * sizes["vocabulary"] * 4
    print(f"{tokens} completion tokens, vocabulary {sizes['vocabulary']}: float32 logits {whole_logits / MB:.0f} MB")
    print("| logits_chunk_tokens | peak MB | peak / float32 logits |")
    print("|---|---|---|")
    for chunk in sizes["chunks"]:
        peak = peak_bytes(policy, sizes["rows"], sizes["completion"], chunk)
        print(f"| {chunk if chunk is not None else 'null (whole)'} | {peak / MB:.0f} | {peak / whole_logits:.2f} |")


if __name__ == "__main__":
    main()
