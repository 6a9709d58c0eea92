"""The warm start's fine-tuning step on one thread against torch's default thread count.

RL runs the embedded model on one thread (``threads`` unset), where its small per-token products are fastest.
A fine-tuning step of the warm start multiplies a whole batch of demonstrations at once; this script times
that step (``unipg.learn.sft.sft_step``: forward, completion loss, backward, AdamW) on the calculator agent's
tool demonstrations, at the batch sizes of ``configs/calculator_agent.yaml``'s two stages, on one thread and on
torch's default count, alternating the two in rounds so that a busy machine slows both alike.

    python benchmarks/threads.py                 # one thread against torch's default count
    python benchmarks/threads.py --threads 4     # another count against one
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from unipg.config import load_config  # noqa: E402
from unipg.config.devices import STARTUP_THREADS, cpu_threads  # noqa: E402
from unipg.learn.sft import make_optimizer, sft_batches, sft_step  # noqa: E402
from unipg.policy.loading import load_causal_lm, load_tokenizer  # noqa: E402
from unipg.sample.episodes import demonstration_pairs  # noqa: E402
from unipg.tasks.base import make_task  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "calculator_agent.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=STARTUP_THREADS, help="the count to compare with one")
    parser.add_argument("--steps", type=int, default=25, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check that the script runs")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.rounds = 2, 1
    config = load_config(CONFIG)
    tokenizer = load_tokenizer(config.model.name)
    task = make_task(
        config.task.name,
        **{
            **config.task.options,
            "tool_demonstrations": 1.0,
            **({"num_train": 64, "num_test": 4} if args.smoke else {}),
        },
    )
    pairs = demonstration_pairs(tokenizer, task, config, task.train)
    batch_sizes = sorted(
        {stage.batch_size or config.sft.batch_size for stage in config.sft.stages} | {config.sft.batch_size}
    )
    print(f"| threads | batch | ms per step (median of {args.rounds} rounds of {args.steps}) |")
    print("|---:|---:|---:|")
    medians = {}
    for batch_size in batch_sizes:
        model = load_causal_lm(config.model.name)
        data, batches, tokens_per_batch = sft_batches(
            model, tokenizer, pairs, batch_size=batch_size, seed=0, group_by_length=config.sft.group_by_length
        )
        optimizer = make_optimizer(model, config.sft.learning_rate, 0.0)
        model.train()
        times = {1: [], args.threads: []}
        for _ in range(args.rounds):
            for threads in times:
                with cpu_threads(threads):
                    sft_step(model, optimizer, data.rows(next(batches)), 1.0, tokens_per_batch)  # warm-up
                    start = time.perf_counter()
                    for _ in range(args.steps):
                        sft_step(model, optimizer, data.rows(next(batches)), 1.0, tokens_per_batch)
                    times[threads].append((time.perf_counter() - start) / args.steps * 1000)
        for threads, rounds in times.items():
            medians[threads, batch_size] = statistics.median(rounds)
            print(f"| {threads} | {batch_size} | {medians[threads, batch_size]:.0f} |")
    for batch_size in batch_sizes:
        print(
            f"1 / {args.threads} threads, batch {batch_size}: "
            f"{medians[1, batch_size] / medians[args.threads, batch_size]:.2f}× as fast on {args.threads}"
        )
    print(f"(torch {torch.__version__}, {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
