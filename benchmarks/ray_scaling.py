"""Rollout throughput of the Ray backend with 1, 2 and 4 rollout workers, against the in-process backend.

Workload: the calculator agent, environment-bound. The policy is the warm start of
``configs/calculator_agent.yaml`` trained on tool demonstrations only (``tool_demonstrations=1.0``), so
nearly every episode calls the calculator, and every call takes ``--latency`` seconds (fixed): an episode
is two short generate calls around one slow tool call. Each worker runs up to ``--episodes`` episodes at
once (``ray.episodes_per_worker``; ``agent.concurrency`` for the in-process backend), so more workers
means more episodes waiting on tools at once.

Rollout runs on the concurrent schedule through the same ``Runtime`` that training uses; the consumer takes
each step's 128 trajectories and publishes the (unchanged) weights as the learner would, but does not
train, so the figure is the rollout side's throughput. The first ``--warmup`` steps are not timed. All
configurations run in one process on one local Ray instance, one after the other, ``--repeats`` times in
turn; the table gives the median of the repeats.

    python benchmarks/ray_scaling.py                       # 3 s tools, 32 episodes per worker
    python benchmarks/ray_scaling.py --workers 1 2 --repeats 1 --steps 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from unipg.config import load_config
from unipg.learn.warm_start import resolve_warm_start
from unipg.policy.loading import policy_from_config
from unipg.runtime.lm_run import build_runtime
from unipg.runtime.prompts import PromptSampler
from unipg.runtime.setup import set_threads
from unipg.sample.episodes import EpisodeRunner
from unipg.tasks.base import make_task
from unipg.tasks.rewards.rules import build_rewards

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "calculator_agent.yaml"


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


def configuration(args, backend: str, workers: int, output_dir: str):
    cpus = os.cpu_count() or 1
    overrides = [
        "task.options={digits: 3, operations: '*', tool_demonstrations: 1.0}",
        f"task.tools=[{{name: calculator, latency: {{kind: fixed, seconds: {args.latency}}}}}]",
        "runtime.max_staleness=4",
        "runtime.schedule=concurrent",
        "agent.tool_timeout=60",
        f"log.output_dir={output_dir}",
        "log.progress=false",
        "log.tensorboard=false",
        f"backend={backend}",
        f"agent.concurrency={args.episodes}",
        *(SMOKE if args.smoke else []),
    ]
    if backend == "ray":
        overrides += [
            f"ray.rollout_workers={workers}",
            f"ray.episodes_per_worker={args.episodes}",
            f"ray.rollout_num_cpus={min(1.0, cpus / workers):g}",
            "ray.env_workers=1",
            "ray.env_num_cpus=0",
        ]
    return load_config(CONFIG, overrides)


def measure(config, args) -> dict[str, float]:
    """Trajectories per second of the rollout side over ``args.steps`` consumer steps."""
    set_threads(config)
    task = make_task(config.task.name, **config.task.options)
    config = resolve_warm_start(config, task)
    reward_fn = build_rewards(config.task.rewards or task.rewards)
    runner = EpisodeRunner(policy_from_config(config), task, config, reward_fn)
    sampler, generator = PromptSampler(task.train, config.seed), torch.Generator().manual_seed(config.seed)
    runtime = build_runtime(config, runner, sampler, generator, task, reward_fn)
    episodes, calls = 0, 0
    try:
        runtime.reset(0)
        for version in range(args.warmup + args.steps):
            if version == args.warmup:
                start = time.perf_counter()
            groups, _ = runtime.next_groups(version)
            if version >= args.warmup:
                trajectories = [t for group in groups for t in group.items]
                episodes += len(trajectories)
                calls += sum(t.tool_calls for t in trajectories)
            runtime.publish(version + 1)
        seconds = time.perf_counter() - start
    finally:
        runtime.close()
        runtime.rollout.close()
        runner.close()
    return {"trajectories_per_second": episodes / seconds, "tool_calls": calls / max(episodes, 1), "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--episodes", type=int, default=32, help="episodes in flight per worker")
    parser.add_argument("--latency", type=float, default=3.0, help="seconds every tool call takes")
    parser.add_argument("--steps", type=int, default=5, help="timed consumer steps of 128 trajectories")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, a few seconds: checks that the script still runs, measures nothing",
    )
    args = parser.parse_args()
    if args.smoke:  # one Ray worker beside the in-process backend: both code paths, one short step each
        args.workers, args.episodes, args.latency, args.steps, args.warmup, args.repeats = [1], 8, 0.01, 1, 0, 1
    import ray

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="WARNING")
    modes = [("inprocess", 1)] + [("ray", workers) for workers in args.workers]
    results: dict[tuple[str, int], list[dict[str, float]]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as output_dir:
        for repeat in range(args.repeats):
            for backend, workers in modes:
                outcome = measure(configuration(args, backend, workers, output_dir), args)
                results[(backend, workers)].append(outcome)
                print(
                    f"repeat {repeat + 1}: {backend:9s} workers {workers}: "
                    f"{outcome['trajectories_per_second']:.2f} trajectories/s, "
                    f"{outcome['tool_calls']:.2f} tool calls per episode",
                    flush=True,
                )
    ray.shutdown()

    median = {mode: statistics.median(r["trajectories_per_second"] for r in runs) for mode, runs in results.items()}
    one = median[("ray", 1)] if ("ray", 1) in median else None
    print(
        f"\n{os.cpu_count()} CPUs; tool latency {args.latency:g} s; {args.episodes} episodes in flight per worker; "
        f"median of {args.repeats} repeat(s) of {args.steps} steps × 128 trajectories"
    )
    print("| backend | rollout workers | trajectories/s | vs Ray with 1 worker | tool calls per episode |")
    print("|---|---|---|---|---|")
    for (backend, workers), value in median.items():
        calls = statistics.fmean(r["tool_calls"] for r in results[(backend, workers)])
        ratio = f"{value / one:.2f}×" if one else "–"
        print(f"| {backend} | {workers} | {value:.2f} | {ratio} | {calls:.2f} |")
    if one:
        inprocess = median[("inprocess", 1)]
        print(
            f"\nRay overhead at 1 worker vs in-process: {(inprocess - one) / inprocess:+.1%} of throughput "
            f"(positive: Ray is slower)"
        )
        if ("ray", 2) in median:
            print(f"scaling 1 → 2 workers: {median[('ray', 2)] / one:.2f}×")


if __name__ == "__main__":
    main()
