"""Asynchronous vs synchronous training of the calculator agent with slow, heavy-tailed tools.

Both runs start from the same warm start (``configs/calculator_agent.yaml``), call a calculator whose every
call takes a log-normal delay (median ``--latency`` seconds, log-space σ ``--sigma``; σ = 1.2 puts the 99th
percentile 16× above the median), and take the same number of learner steps. They differ only in the runtime:

- sync:  ``runtime.max_staleness=0`` — every step samples its batch with the current weights and waits for
  its slowest episode;
- async: ``runtime.max_staleness=η``, concurrent schedule — rollout runs on a background thread on a synced
  copy of the weights while the learner trains; the objective corrects for the stale samples
  (``--objective``, decoupled PPO by default);
- partial: async with ``runtime.partial_rollouts`` (``--engine vllm``): a weight load interrupts the turns in
  flight, which go on under the new weights, instead of waiting for them to finish.

Printed per run: wall-clock of the learner steps (evaluation excluded), trajectories per second, the mean
learner idle fraction, the mean trajectory staleness, and the held-out greedy completion rate at the end.
The two runs go one after the other in one process, on the same machine.

    python benchmarks/async_vs_sync.py                       # 30 steps, η = 8
    python benchmarks/async_vs_sync.py --updates 10 --eta 2 --objective ppo
    python benchmarks/async_vs_sync.py --engine vllm --modes async partial
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
from pathlib import Path

from unipg.config import load_config
from unipg.observe.metrics import read_metrics
from unipg.runtime.lm import train_lm

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "calculator_agent.yaml"
OBJECTIVES = {
    "ppo": [],
    "decoupled_ppo": ["estimator.policy_loss=decoupled_ppo"],
    "truncated_is": ["estimator.off_policy_weight=truncated_is"],
    "age_decay": ["estimator.off_policy_weight=age_decay"],
}
# --smoke: a tiny run of the same code path, to check that the script still runs (its figures mean nothing)
SMOKE = [
    "task.options={digits: 1, num_train: 16, num_test: 4, tool_demonstrations: 1.0}",
    "model.warm_start=false",
    "train.batch_size=8",
    "train.mini_batch_size=8",
    "train.micro_batch_size=8",
    "sample.samples_per_prompt=4",
    "sample.max_new_tokens=8",
    "agent.max_total_tokens=40",
    "eval.max_examples=4",
    "eval.pass_k=0",
]


def run(mode: str, args, output_dir: str) -> dict[str, float]:
    latency = f"{{kind: lognormal, seconds: {args.latency}, sigma: {args.sigma}}}"
    overrides = [
        f"task.tools=[{{name: calculator, latency: {latency}}}]",
        f"train.updates={args.updates}",
        f"eval.every_updates={args.updates}",
        f"eval.max_examples={args.eval_examples}",
        f"log.output_dir={output_dir}",
        f"log.run_name={mode}",
        "log.progress=false",
        "log.tensorboard=false",
        "log.monitor=false",
        "checkpoint.every_updates=0",
        "agent.tool_timeout=60",
        f"seed={args.seed}",
        f"agent.batch_wait_ms={args.batch_wait_ms}",
        f"sample.engine={args.engine}",
    ]
    if mode != "sync":
        overrides += [f"runtime.max_staleness={args.eta}", "runtime.schedule=concurrent", *OBJECTIVES[args.objective]]
    if mode == "partial":
        overrides.append("runtime.partial_rollouts=true")
    config = load_config(CONFIG, overrides + (SMOKE if args.smoke else []))
    result = train_lm(config)
    steps = [r for r in read_metrics(result.run_dir) if "train/loss" in r]
    return {
        "seconds": result.train_seconds,
        "trajectories_per_second": result.samples_per_second,
        "learner_idle": statistics.fmean(r["timing/learner_idle_fraction"] for r in steps),
        "staleness": statistics.fmean(r["async/staleness_trajectory_mean"] for r in steps),
        "tool_calls": statistics.fmean(r.get("rollout/tool_calls", 0.0) for r in steps),
        "interrupted": sum(r.get("engine/turns_interrupted", 0.0) for r in steps),
        "initial": result.initial_eval["eval/pass@1"],
        "final": result.final_eval["eval/pass@1"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=30, help="learner steps per run")
    parser.add_argument("--eta", type=int, default=8, help="max_staleness of the async run")
    parser.add_argument("--objective", choices=sorted(OBJECTIVES), default="decoupled_ppo")
    parser.add_argument("--latency", type=float, default=0.5, help="median tool delay, seconds")
    parser.add_argument("--sigma", type=float, default=1.2, help="log-space σ of the tool delay")
    parser.add_argument("--eval-examples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", nargs="+", default=["sync", "async"], choices=["sync", "async", "partial"])
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="the inference engine of every run")
    parser.add_argument(
        "--batch-wait-ms",
        type=float,
        default=5.0,
        help="how long the inference engine waits to fill a generate batch (both runs)",
    )
    parser.add_argument("--output-dir", help="keep the runs here (default: a temporary folder)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, a few seconds: checks that the script still runs, measures nothing",
    )
    args = parser.parse_args()
    if args.smoke:
        args.updates, args.eta, args.latency, args.eval_examples = 2, 1, 0.01, 4
    tail = math.exp(2.3263 * args.sigma)
    print(
        f"tool latency: log-normal, median {args.latency:g} s, p99 {args.latency * tail:.2f} s "
        f"(p99/median {tail:.1f}); {args.updates} learner steps of 128 trajectories"
    )
    if args.output_dir:
        results = {mode: run(mode, args, args.output_dir) for mode in args.modes}
    else:
        with tempfile.TemporaryDirectory() as output_dir:
            results = {mode: run(mode, args, output_dir) for mode in args.modes}
    print(
        "\n| run | steps wall-clock (s) | trajectories/s | learner idle | staleness | tool calls/episode "
        "| completion before → after | turns interrupted |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        label = mode if mode == "sync" else f"{mode} (η={args.eta}, {args.objective}, {args.engine})"
        print(
            f"| {label} | {r['seconds']:.0f} | {r['trajectories_per_second']:.2f} | {r['learner_idle']:.1%} "
            f"| {r['staleness']:.2f} | {r['tool_calls']:.2f} | {r['initial']:.3f} → {r['final']:.3f} "
            f"| {r['interrupted']:.0f} |"
        )
    if len(results) == 2:
        (first, a), (second, b) = results.items()
        speedup = b["trajectories_per_second"] / a["trajectories_per_second"]
        gap = 100 * (b["final"] - a["final"])
        print(
            f"\n{second} / {first} throughput: {speedup:.2f}×; final completion {second} − {first}: {gap:+.1f} points"
        )


if __name__ == "__main__":
    main()
