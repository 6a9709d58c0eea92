"""How well a model copies in a tool task: into the call, and out of the tool's result into the answer.

An agent task that a small model solves with a tool needs two copies: the problem's arguments into the call
(measured as the warm start's evidence does: greedy first turns on held-out problems, ``unipg.learn.evidence``)
and the tool's result into the final answer. The second is measured teacher-forced: the demonstration's call
and the tool's result are put in the context and the greedy answer is compared with the result, by the
result's length (a model that copies by position learns the common length and fails the others).

    python benchmarks/copying.py --model ~/.cache/unipg/warm-start/calculator-<key>
    python benchmarks/copying.py --model runs/<run>/policy --config configs/units_agent.yaml --examples 200
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import torch

import unipg  # noqa: F401  (before transformers: hides torch companions that do not match torch)

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ["task.options={digits: 1, num_train: 16, num_test: 4, tool_demonstrations: 1.0}"]


def answer_copies(model, tokenizer, task, config, examples) -> dict[int, tuple[int, int]]:
    """{length of the result: (copied, examples)}: the greedy last turn after the demonstration's call and result."""
    from unipg.learn.evidence import answer_turns

    counts: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0])
    for turn, answer in answer_turns(model, tokenizer, task, config, examples):
        counts[len(answer)][0] += turn == answer
        counts[len(answer)][1] += 1
    return {length: (copied, total) for length, (copied, total) in sorted(counts.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model folder (a warm start, a run's policy); default: the embedded model")
    parser.add_argument("--config", default=str(ROOT / "configs" / "calculator_agent.yaml"))
    parser.add_argument("--examples", type=int, default=100, help="held-out problems")
    parser.add_argument("--smoke", action="store_true", help="an untrained model on a tiny task, in seconds")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from unipg.config import load_config
    from unipg.learn.evidence import call_evidence
    from unipg.policy.embedded import resolve_model_name
    from unipg.policy.loading import load_tokenizer
    from unipg.tasks.base import TASKS

    torch.set_num_threads(1)
    path = resolve_model_name(args.model or "embedded")
    config = load_config(args.config, [f"model.name={path}", "model.warm_start=false", *(SMOKE if args.smoke else [])])
    tokenizer, model = load_tokenizer(path), AutoModelForCausalLM.from_pretrained(path).eval()
    task = TASKS.get(config.task.name)(**dict(config.task.options))
    examples = [
        example
        for example in task.test[: args.examples]
        if not isinstance(example.solution, str) and len(example.solution) >= 3
    ]
    evidence = call_evidence(model, tokenizer, task, config, examples)
    print(f"{config.task.name}, {len(examples)} held-out problems, model {args.model or 'embedded'}")
    print("call: " + ", ".join(f"{name} {value:.3f}" for name, value in evidence.items()))
    print("| result length | problems | result copied |")
    print("|---:|---:|---:|")
    for length, (copied, total) in answer_copies(model, tokenizer, task, config, examples).items():
        print(f"| {length} | {total} | {copied / total:.0%} |")


if __name__ == "__main__":
    main()
