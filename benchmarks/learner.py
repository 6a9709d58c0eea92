"""The language-model learner at scale: padded against packed micro-batches as the token budget and the spread of
response lengths grow, generation against the same spread, the learner step against a bare training step, and the
per-rank memory of FSDP2 sharding. Each figure of a section is the fastest of its runs, taken in turns.

    python benchmarks/learner.py             # the figures in docs/benchmarks.md
    python benchmarks/learner.py --smoke     # tiny sizes, seconds

1. Budget: one learner update (one epoch, one optimizer step) of the same length-skewed batch of agent
   trajectories (GRPO groups of 4 sharing a prompt; most completions short, a quarter of them ten times longer)
   with ``train.max_tokens_per_micro_batch`` at each budget: padded (``train.micro_batch_size`` at the budget
   over the mean sequence length, so both paths run about as many micro-batches), packed with segment attention
   (the default), and packed with the dense block-diagonal mask Hugging Face derives from the position resets
   (what packed passes ran before). Seconds per real token, and the exponent of a least-squares fit of
   log(seconds per packed micro-batch) against log(budget): 1 is linear in the budget, 2 quadratic.
2. Spread: the same update on batches whose completion lengths spread further and further (the padded path's
   padding fraction from ~10 % to ~70 %; the same real tokens), padded against the default configuration; the
   hf engine's ``generate`` on completions of the same lengths (the context fixes each row's length, EOS is off);
   and, at 10 % padding, longer and longer shared prompts, which both paths run once per group (packing lays each
   distinct prompt once in its row, ``unipg.policy.packed``): what sharing saves each path, and ``auto``'s choice.
3. The packed learner step against a bare step of the same model on the same packed micro-batches: forward,
   −Σ log-prob of the completion tokens, backward, AdamW. What the learner adds (the objective, its metrics,
   gradient clipping, batch layout) is the difference.
4. Bytes one rank holds for parameters, gradients and AdamW state, after one step: the whole model in one
   process, and each rank of the model sharded with FSDP2 (``fully_shard`` per decoder layer) over 2 local
   gloo processes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from unipg.config import load_config  # noqa: E402
from unipg.learn.distributed import init_local_group, resident_bytes, shard_model, spawn_local  # noqa: E402
from unipg.learn.lm import LMLearner  # noqa: E402
from unipg.learn.lm_batch import LMBatch  # noqa: E402
from unipg.learn.micro_batches import padded_pass_tokens  # noqa: E402
from unipg.policy.embedded import resolve_model_name  # noqa: E402
from unipg.policy.forward import left_pad  # noqa: E402
from unipg.policy.generation import generate  # noqa: E402
from unipg.policy.loading import load_causal_lm, load_lm_policy  # noqa: E402
from unipg.policy.packed import pack_rows, packed_forward  # noqa: E402

GROUP = 4
BUDGETS = (1536, 3072, 6144)
PADDING_TARGETS = (0.1, 0.3, 0.5, 0.7)
PROMPT_LENGTH = 32  # tokens of every prompt of the spread batches
CONTEXT = 512  # the embedded models' positions
SHARING_SHAPES = ((32, 64), (96, 32), (200, 24))  # (prompt, mean completion) tokens: more and more shared
DENSE_SDPA = "sdpa_dense_packed"


def use_dense_packing(model) -> None:
    """Put ``model`` on sdpa under another name, so that its packed passes take the dense block-diagonal mask
    Hugging Face derives from the position resets (as every packed pass did before segment attention)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    AttentionInterface.register(DENSE_SDPA, ALL_ATTENTION_FUNCTIONS["sdpa"])
    AttentionMaskInterface.register(DENSE_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.config._attn_implementation = DENSE_SDPA


def batch_of(prompts: list[list[int]], lengths: list[int], generator: torch.Generator) -> LMBatch:
    """Each prompt GROUP times, followed by random completions of ``lengths``, random advantages."""
    count = len(lengths)
    prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(GROUP)], 0)
    ids, real = torch.zeros((count, max(lengths)), dtype=torch.long), torch.zeros((count, max(lengths)))
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.randint(8, 90, (length,), generator=generator)
        real[row, :length] = 1
    batch = LMBatch(
        input_ids=torch.cat([prompt_ids, ids], 1),
        attention_mask=torch.cat([prompt_mask, real.long()], 1),
        completion_mask=real,
        behaviour_logprobs=-4.0 * real,
        scores=torch.zeros(count),
    )
    batch.advantages = torch.randn(real.shape, generator=generator) * real
    return batch


def skewed_batch(count: int, long_length: int, seed: int = 0) -> LMBatch:
    """``count`` trajectories in groups of GROUP sharing a prompt; 3 in 4 completions 8–40 tokens long, the
    rest ``long_length``/2 to ``long_length``."""
    generator = torch.Generator().manual_seed(seed)
    draw = lambda low, high: int(torch.randint(low, high + 1, (), generator=generator))  # noqa: E731
    prompts = [torch.randint(8, 90, (draw(24, 48),), generator=generator).tolist() for _ in range(count // GROUP)]
    lengths = [draw(long_length // 2, long_length) if draw(0, 3) == 0 else draw(8, 40) for _ in range(count)]
    return batch_of(prompts, lengths, generator)


def spread_lengths(count: int, mean: int, micro: int, padding: float, prompt: int) -> list[int]:
    """Completion lengths averaging ``mean`` for which padded micro-batches of ``micro`` rows (``prompt``-token
    prompts) are ``padding`` pad tokens: in every micro-batch one long completion (at a random place), the rest
    short ones that keep the mean."""
    generator = torch.Generator().manual_seed(0)
    longest = round((prompt + mean) / (1 - padding)) - prompt
    short = max(1, round((micro * mean - longest) / (micro - 1)))
    lengths = []
    for _ in range(count // micro):
        group = [short] * micro
        group[int(torch.randint(micro, (), generator=generator))] = longest
        lengths += group
    return lengths


def spread_batch(count: int, mean: int, micro: int, padding: float, prompt: int = PROMPT_LENGTH) -> LMBatch:
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(8, 90, (prompt,), generator=generator).tolist() for _ in range(count // GROUP)]
    return batch_of(prompts, spread_lengths(count, mean, micro, padding, prompt), generator)


def padding_fraction(batch: LMBatch, micro: int) -> float:
    """The share of pad tokens in the padded path's micro-batches of ``micro`` rows."""
    rows = batch.attention_mask.sum(1).split(micro)
    return 1 - sum(int(r.sum()) for r in rows) / sum(len(r) * int(r.max()) for r in rows)


def learner(model_name: str, count: int, *overrides: str) -> LMLearner:
    torch.manual_seed(0)
    config = load_config(
        None,
        [
            "task.name=arithmetic",
            "algorithm=grpo",
            f"train.batch_size={count}",
            f"train.mini_batch_size={count}",
            f"train.micro_batch_size={count}",
            "train.num_epochs=1",
            "estimator.kl_coef=0.0",
            f"sample.samples_per_prompt={GROUP}",
            "sample.max_new_tokens=512",
            *overrides,
        ],
    )
    return LMLearner(load_lm_policy(model_name), config)


def timed(rows: list[dict], repeats: int) -> list[dict]:
    """``rows`` with each callable under a ``*_s`` key replaced by the fastest of ``repeats`` runs of it after one
    warm-up run. The runs go round all of them in turn, so that a change of the shared machine's load reaches
    every figure alike."""
    steps = [(row, key) for row in rows for key, value in row.items() if key.endswith("_s") and callable(value)]
    seconds: dict[tuple[int, str], list[float]] = {(id(row), key): [] for row, key in steps}
    for round_ in range(repeats + 1):
        for row, key in steps:
            start = time.perf_counter()
            row[key]()
            if round_:
                seconds[id(row), key].append(time.perf_counter() - start)
    for row, key in steps:
        row[key] = min(seconds[id(row), key])
    return rows


def exponent(budgets, seconds) -> float:
    """The slope of the least-squares line through (log budget, log seconds)."""
    x, y = [math.log(b) for b in budgets], [math.log(s) for s in seconds]
    mx, my = sum(x) / len(x), sum(y) / len(y)
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / sum((a - mx) ** 2 for a in x)


def budget_sweep(model_name: str, batch: LMBatch, budgets, repeats: int) -> list[dict]:
    """Section 1: per budget, seconds of the padded, packed and dense packed update and the packed micro-batches."""
    count, tokens = len(batch.scores), int(batch.attention_mask.sum())
    rows = []
    for budget in budgets:
        micro = min((d for d in range(1, count + 1) if count % d == 0), key=lambda d: abs(d - budget * count / tokens))
        padded = learner(model_name, count, f"train.micro_batch_size={micro}", "train.max_tokens_per_micro_batch=null")
        packed = learner(model_name, count, f"train.max_tokens_per_micro_batch={budget}")
        dense = learner(model_name, count, f"train.max_tokens_per_micro_batch={budget}")
        use_dense_packing(dense.policy.model)
        rows.append(
            {
                "budget": budget,
                "micro_batches": len(packed.micro_batches(batch, torch.arange(count))),
                "padded_s": lambda padded=padded: padded.update(batch),
                "packed_s": lambda packed=packed: packed.update(batch),
                "dense_s": lambda dense=dense: dense.update(batch),
            }
        )
    return timed(rows, repeats)


def spread_sweep(model_name: str, count: int, mean: int, micro: int, repeats: int) -> list[dict]:
    """Section 2: per padding target, seconds of the padded and the default update, and of generation."""
    rows = []
    for target in PADDING_TARGETS:
        batch = spread_batch(count, mean, micro, target)
        padded = learner(model_name, count, f"train.micro_batch_size={micro}", "train.max_tokens_per_micro_batch=null")
        default = learner(model_name, count, f"train.micro_batch_size={micro}")
        completions = batch.completion_mask.sum(1).long().tolist()
        rows.append(
            {
                "padding": padding_fraction(batch, micro),
                "tokens": int(batch.attention_mask.sum()),
                "generated": sum(completions),
                "padded_s": lambda padded=padded, batch=batch: padded.update(batch),
                "default_s": lambda default=default, batch=batch: default.update(batch),
                "generate_s": lambda policy=default.policy, lengths=completions: generate_lengths(policy, lengths),
            }
        )
    return timed(rows, repeats)


def sharing_sweep(model_name: str, count: int, micro: int, shapes, repeats: int) -> list[dict]:
    """Section 2, shared prompts: per (prompt, mean completion) at 10 % padding, seconds of the padded and the
    packed update, the tokens each computes, and which ``auto`` picks."""
    rows = []
    for prompt, mean in shapes:
        batch = spread_batch(count, mean, micro, 0.1, prompt)
        every = torch.arange(count)
        width = batch.input_ids.shape[1] - batch.completion_length
        padded_tokens = sum(
            padded_pass_tokens(batch.input_ids[g, :width], batch.attention_mask[g], width) for g in every.split(micro)
        )
        budget = micro * int(batch.attention_mask.sum(1).max())
        padded = learner(model_name, count, f"train.micro_batch_size={micro}", "train.max_tokens_per_micro_batch=null")
        packed = learner(
            model_name, count, f"train.micro_batch_size={micro}", f"train.max_tokens_per_micro_batch={budget}"
        )
        auto = learner(model_name, count, f"train.micro_batch_size={micro}")
        auto.micro_batches(batch, every)
        packed_tokens = sum(
            pack_rows(
                batch.input_ids[g], batch.attention_mask[g], batch.completion_length, share_prompts=True
            ).input_ids.shape[1]
            for g in packed.micro_batches(batch, every)
        )
        rows.append(
            {
                "prompt": prompt,
                "mean": mean,
                "token_ratio": packed_tokens / padded_tokens,
                "auto": "packed" if auto.policy.packed else "padded",
                "padded_s": lambda padded=padded, batch=batch: padded.update(batch),
                "packed_s": lambda packed=packed, batch=batch: packed.update(batch),
            }
        )
    return timed(rows, repeats)


def generate_lengths(policy, lengths: list[int]) -> None:
    """Sample completions of exactly ``lengths`` tokens: each prompt fills the context up to its row's length,
    and no token ends a row early."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(8, 90, (CONTEXT - n,), generator=generator).tolist() for n in lengths]
    policy.eos_ids, policy.context_length = [], CONTEXT
    with torch.no_grad():
        out = generate(policy, prompts, max_new_tokens=max(lengths), generator=generator)
    assert out.completion_mask.sum(1).long().tolist() == lengths


def bare_step(model, optimizer, batch: LMBatch, groups: list) -> None:
    """Forward, −Σ log-prob of the completion tokens, backward and AdamW on pre-packed micro-batches."""
    optimizer.zero_grad(set_to_none=True)
    for packing in groups:
        logits = packed_forward(model, packing).logits
        logprobs = torch.log_softmax(logits.float(), -1).gather(-1, packing.targets[:, None])
        (-logprobs.sum() / len(batch.scores)).backward()
    optimizer.step()


def step_overhead(model_name: str, batch: LMBatch, budget: int, repeats: int) -> dict[str, float]:
    """Section 3: seconds of the packed learner update and of a bare step on the same micro-batches."""
    count = len(batch.scores)
    packed = learner(model_name, count, f"train.max_tokens_per_micro_batch={budget}")
    rows = packed.micro_batches(batch, torch.arange(count))
    model = load_causal_lm(model_name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    packings = [
        pack_rows(sub.input_ids, sub.attention_mask, sub.completion_length, share_prompts=True)
        for sub in map(batch.rows, rows)
    ]
    step = {
        "micro_batches": len(rows),
        "packed_s": lambda: packed.update(batch),
        "bare_s": lambda: bare_step(model, optimizer, batch, packings),
    }
    return timed([step], repeats)[0]


def memory_rank(rank: int, world_size: int, port: int, model_name: str, out: str) -> None:
    """One rank of the memory measurement: shard, one step, write the bytes this rank holds."""
    torch.set_num_threads(1)
    if world_size > 1:
        init_local_group(rank, world_size, port)
    torch.manual_seed(0)
    model = load_causal_lm(model_name)
    if world_size > 1:
        shard_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(8, 90, (2, 32), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean().backward()
    optimizer.step()
    Path(out, f"rank{rank}.json").write_text(json.dumps(resident_bytes(list(model.parameters()), optimizer)))
    if world_size > 1:
        torch.distributed.destroy_process_group()


def memory(model_name: str) -> dict[int, int]:
    """Section 4: the largest per-rank bytes of params + grads + AdamW state with 1 and with 2 processes."""
    held = {}
    for world_size in (1, 2):
        with tempfile.TemporaryDirectory() as out:
            if world_size == 1:
                memory_rank(0, 1, 0, model_name, out)
            else:
                spawn_local(memory_rank, world_size, model_name, out)
            held[world_size] = max(json.loads(path.read_text()) for path in Path(out).glob("rank*.json"))
    return held


def print_budgets(rows: list[dict], tokens: int) -> None:
    print("| budget | packed micro-batches | padded µs/token | packed µs/token | dense packed µs/token |")
    print("|---:|---:|---:|---:|---:|")
    for row in rows:
        per_token = [f"{row[key] / tokens * 1e6:,.0f}" for key in ("padded_s", "packed_s", "dense_s")]
        print(f"| {row['budget']:,} | {row['micro_batches']} | " + " | ".join(per_token) + " |")
    budgets = [row["budget"] for row in rows]
    fits = {
        key: exponent(budgets, [row[key] / row["micro_batches"] for row in rows]) for key in ("packed_s", "dense_s")
    }
    print(
        f"exponent of seconds per packed micro-batch against budget: packed {fits['packed_s']:.2f} (goal <= 1.15), "
        f"dense packed {fits['dense_s']:.2f}"
    )


def print_spreads(rows: list[dict]) -> None:
    print("| padding | real tokens | padded µs/token | default µs/token | generated tokens | generate µs/token |")
    print("|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['padding']:.0%} | {row['tokens']:,} | {row['padded_s'] / row['tokens'] * 1e6:,.0f} | "
            f"{row['default_s'] / row['tokens'] * 1e6:,.0f} | {row['generated']:,} | "
            f"{row['generate_s'] / row['generated'] * 1e6:,.0f} |"
        )
    spread = {
        key: max(r[key] / r[total] for r in rows) / min(r[key] / r[total] for r in rows)
        for key, total in (("padded_s", "tokens"), ("default_s", "tokens"), ("generate_s", "generated"))
    }
    print(
        f"most / least µs per token across spreads: padded {spread['padded_s']:.2f}, default "
        f"{spread['default_s']:.2f} (goal <= 1.3), generate {spread['generate_s']:.2f}"
    )


def print_sharing(rows: list[dict]) -> None:
    print("| prompt | mean completion | packed / padded tokens | packed / padded seconds | auto picks |")
    print("|---:|---:|---:|---:|---|")
    for row in rows:
        print(
            f"| {row['prompt']} | {row['mean']} | {row['token_ratio']:.2f} | "
            f"{row['packed_s'] / row['padded_s']:.2f} | {row['auto']} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded:small")
    parser.add_argument("--trajectories", type=int, default=96)
    parser.add_argument("--long", type=int, default=300, help="longest completion of the skewed batch, in tokens")
    parser.add_argument("--mean", type=int, default=64, help="mean completion of the spread batches, in tokens")
    parser.add_argument("--micro", type=int, default=8, help="sequences per padded micro-batch (sections 2-3)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: a check that the script runs")
    args = parser.parse_args()
    budgets, shapes = BUDGETS, SHARING_SHAPES
    if args.smoke:
        args.model, args.trajectories, args.long, args.mean, args.micro, args.repeats = "embedded", 8, 40, 12, 4, 1
        budgets, shapes = (96, 192), ((8, 12), (40, 6))
    torch.set_num_threads(args.threads)
    model_name = resolve_model_name(args.model)
    batch = skewed_batch(args.trajectories, args.long)
    tokens = int(batch.attention_mask.sum())
    print(
        f"model {args.model}, {args.trajectories} trajectories, {tokens} real tokens "
        f"({batch.attention_mask.numel()} padded), {args.threads} thread(s)"
    )
    print_budgets(budget_sweep(model_name, batch, budgets, args.repeats), tokens)
    print(f"\n{args.trajectories} trajectories, completions {args.mean} tokens on average, padded {args.micro} a row")
    print_spreads(spread_sweep(model_name, args.trajectories, args.mean, args.micro, args.repeats))
    print("\nshared prompts, 10 % padding; both paths run each distinct prompt once, auto packs")
    print_sharing(sharing_sweep(model_name, args.trajectories, args.micro, shapes, args.repeats))
    step = step_overhead(model_name, batch, budgets[0], args.repeats)
    print("\n| step | micro-batches | seconds | tokens/s |\n|---|---:|---:|---:|")
    for name, key in (("learner, packed", "packed_s"), ("bare step, packed", "bare_s")):
        print(f"| {name} | {step['micro_batches']} | {step[key]:.3f} | {tokens / step[key]:,.0f} |")
    print(f"learner / bare step tokens/s: {step['bare_s'] / step['packed_s']:.2f} (goal >= 0.9)")
    held = memory(model_name)
    print(
        f"per-rank params + grads + AdamW state: N=1 {held[1] / 2**20:.2f} MiB, N=2 {held[2] / 2**20:.2f} MiB, "
        f"ratio {held[2] / held[1]:.2f} (goal <= 0.6)"
    )


if __name__ == "__main__":
    main()
