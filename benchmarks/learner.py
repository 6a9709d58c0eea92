"""The language-model learner at scale: padded against packed micro-batches, the learner step against a bare
training step, and the per-rank memory of FSDP2 sharding.

    python benchmarks/learner.py             # the figures in docs/benchmarks.md
    python benchmarks/learner.py --smoke     # tiny sizes, seconds

1. Throughput on a length-skewed batch of agent trajectories (GRPO groups of 4 sharing a prompt; most
   completions short, a quarter of them ten times longer): one learner update (one epoch, one optimizer
   step) with ``train.micro_batch_size`` sequences padded to the longest, against the same update with
   ``train.max_tokens_per_micro_batch`` packing each micro-batch into one padding-free row (the budget is the
   batch's real tokens over the padded path's micro-batch count, so both run about as many micro-batches).
   tokens/s counts real (prompt + completion) tokens.
2. The packed learner step against a bare step of the same model on the same packed micro-batches: forward,
   −Σ log-prob of the completion tokens, backward, AdamW. What the learner adds (the objective, its metrics,
   gradient clipping, batch layout) is the difference.
3. Bytes one rank holds for parameters, gradients and AdamW state, after one step: the whole model in one
   process, and each rank of the model sharded with FSDP2 (``fully_shard`` per decoder layer) over 2 local
   gloo processes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from unipg.config import load_config  # noqa: E402
from unipg.learn.distributed import init_local_group, resident_bytes, shard_model, spawn_local  # noqa: E402
from unipg.learn.lm import LMLearner  # noqa: E402
from unipg.learn.lm_batch import LMBatch  # noqa: E402
from unipg.policy.embedded import resolve_model_name  # noqa: E402
from unipg.policy.forward import left_pad  # noqa: E402
from unipg.policy.loading import load_causal_lm, load_lm_policy  # noqa: E402
from unipg.policy.packed import pack_rows  # noqa: E402

GROUP = 4


def skewed_batch(count: int, long_length: int, seed: int = 0) -> LMBatch:
    """``count`` trajectories in groups of GROUP sharing a prompt; 3 in 4 completions 8–40 tokens long, the
    rest ``long_length``/2 to ``long_length``."""
    generator = torch.Generator().manual_seed(seed)
    draw = lambda low, high: int(torch.randint(low, high + 1, (), generator=generator))  # noqa: E731
    prompts = [torch.randint(8, 90, (draw(24, 48),), generator=generator).tolist() for _ in range(count // GROUP)]
    prompt_ids, prompt_mask = left_pad([p for p in prompts for _ in range(GROUP)], 0)
    lengths = [draw(long_length // 2, long_length) if draw(0, 3) == 0 else draw(8, 40) for _ in range(count)]
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


def learner(model_name: str, count: int, *overrides: str) -> LMLearner:
    torch.manual_seed(0)
    config = load_config(
        None,
        [
            "task.name=arithmetic",
            "algorithm=grpo",
            f"train.batch_size={count}",
            f"train.mini_batch_size={count}",
            "train.num_epochs=1",
            "estimator.kl_coef=0.0",
            f"sample.samples_per_prompt={GROUP}",
            "sample.max_new_tokens=512",
            *overrides,
        ],
    )
    return LMLearner(load_lm_policy(model_name), config)


def timed(step, repeats: int) -> float:
    """The fastest of ``repeats`` runs of ``step`` after one warm-up run (the machine is shared)."""
    step()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    return min(seconds)


def bare_step(model, optimizer, batch: LMBatch, groups: list[torch.Tensor]) -> None:
    """Forward, −Σ log-prob of the completion tokens, backward and AdamW on pre-packed micro-batches."""
    optimizer.zero_grad(set_to_none=True)
    for packing in groups:
        logits = model(
            input_ids=packing.input_ids,
            position_ids=packing.position_ids,
            attention_mask=None,
            use_cache=False,
            logits_to_keep=packing.predictors,
        ).logits[0]
        logprobs = torch.log_softmax(logits.float(), -1).gather(-1, packing.targets[:, None])
        (-logprobs.sum() / len(batch.scores)).backward()
    optimizer.step()


def throughput(model_name: str, batch: LMBatch, padded_micro: int, repeats: int) -> dict[str, float]:
    count, tokens = len(batch.scores), int(batch.attention_mask.sum())
    padded = learner(model_name, count, f"train.micro_batch_size={padded_micro}")
    budget = -(-tokens // -(-count // padded_micro))
    packed = learner(model_name, count, f"train.max_tokens_per_micro_batch={budget}")
    rows = packed.micro_batches(batch, torch.arange(count))
    results = {
        "tokens": tokens,
        "budget": budget,
        "packed_micro_batches": len(rows),
        "padded_micro_batches": -(-count // padded_micro),
        "padded_s": timed(lambda: padded.update(batch), repeats),
        "packed_s": timed(lambda: packed.update(batch), repeats),
    }
    model = load_causal_lm(model_name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    packings = [
        pack_rows(sub.input_ids, sub.attention_mask, sub.completion_length)
        for sub in (batch.rows(index) for index in rows)
    ]
    results["bare_s"] = timed(lambda: bare_step(model, optimizer, batch, packings), repeats)
    return results


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
    """The largest per-rank bytes of params + grads + AdamW state with 1 and with 2 processes."""
    held = {}
    for world_size in (1, 2):
        with tempfile.TemporaryDirectory() as out:
            if world_size == 1:
                memory_rank(0, 1, 0, model_name, out)
            else:
                spawn_local(memory_rank, world_size, model_name, out)
            held[world_size] = max(json.loads(path.read_text()) for path in Path(out).glob("rank*.json"))
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded:small")
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--long", type=int, default=300, help="longest completion, in tokens")
    parser.add_argument("--micro", type=int, default=8, help="sequences per padded micro-batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: a check that the script runs")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.trajectories, args.long, args.micro, args.repeats = "embedded", 8, 40, 4, 1
    torch.set_num_threads(args.threads)
    model_name = resolve_model_name(args.model)
    batch = skewed_batch(args.trajectories, args.long)
    result = throughput(model_name, batch, args.micro, args.repeats)
    tokens = result["tokens"]
    print(
        f"model {args.model}, {args.trajectories} trajectories, {tokens} real tokens "
        f"({batch.attention_mask.numel()} padded), {args.threads} thread(s)"
    )
    print("| step | micro-batches | seconds | tokens/s |\n|---|---:|---:|---:|")
    for name, key, micro in (
        ("learner, padded", "padded_s", "padded_micro_batches"),
        ("learner, packed", "packed_s", "packed_micro_batches"),
        ("bare step, packed", "bare_s", "packed_micro_batches"),
    ):
        print(f"| {name} | {result[micro]} | {result[key]:.3f} | {tokens / result[key]:,.0f} |")
    print(f"packed / padded tokens/s: {result['padded_s'] / result['packed_s']:.2f} (goal >= 1.5)")
    print(f"learner / bare step tokens/s: {result['bare_s'] / result['packed_s']:.2f} (goal >= 0.9)")
    held = memory(model_name)
    print(
        f"per-rank params + grads + AdamW state: N=1 {held[1] / 2**20:.2f} MiB, N=2 {held[2] / 2**20:.2f} MiB, "
        f"ratio {held[2] / held[1]:.2f} (goal <= 0.6)"
    )


if __name__ == "__main__":
    main()
