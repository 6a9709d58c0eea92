"""Staleness ablation: PPO on CartPole-v1 trained on data exactly η learner versions old.

Every run uses ``configs/cartpole_ppo.yaml`` with ``runtime.schedule=sequential`` and
``runtime.max_staleness=η``: the rollout fills the buffer η + 1 segments ahead, so after the first η
learner steps every step trains on a segment collected η versions earlier — controlled, reproducible
staleness. Objectives (how the learner treats the stale segment):

- ``naive_ppo``: PPO-clip against the behaviour policy μ, as if the data were fresh;
- ``decoupled_ppo``: clip against the current (proximal) policy, corrected by π_prox / μ;
- ``decoupled_ppo_cap5``: the same with π_prox / μ truncated at 5;
- ``truncated_is``: PPO-clip against μ times min(ρ, 2), ρ = π_θ / μ;
- ``age_decay_0.9`` / ``age_decay_0.99``: PPO-clip against μ times γ_age^η.

For every objective stale segments get the current critic's values before GAE (``prepare_segment``).
Reported per cell, mean ± std over seeds: environment steps (trained on) until the deterministic evaluation
mean (20 episodes) first reaches 475, and the final evaluation return. Runs that never reach 475 are counted
out of the mean and shown as (reached/seeds).

    python benchmarks/staleness_ablation.py --jobs 2
    python benchmarks/staleness_ablation.py --etas 0 4 --objectives naive_ppo decoupled_ppo --seeds 0
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "cartpole_ppo.yaml"
THRESHOLD = 475.0
OBJECTIVES = {
    "naive_ppo": [],
    "decoupled_ppo": ["estimator.policy_loss=decoupled_ppo"],
    "decoupled_ppo_cap5": ["estimator.policy_loss=decoupled_ppo", "estimator.behaviour_weight_cap=5"],
    "truncated_is": ["estimator.off_policy_weight=truncated_is"],
    "age_decay_0.9": ["estimator.off_policy_weight=age_decay", "estimator.sample_age_decay=0.9"],
    "age_decay_0.99": ["estimator.off_policy_weight=age_decay", "estimator.sample_age_decay=0.99"],
}
DEFAULT_OBJECTIVES = ["naive_ppo", "decoupled_ppo", "truncated_is", "age_decay_0.9"]
# At η = 0 these are naive PPO exactly (π_prox = μ; γ_age^0 = 1), bit for bit, so its runs are reused.
SAME_AS_NAIVE_WHEN_FRESH = {"decoupled_ppo", "decoupled_ppo_cap5", "age_decay_0.9", "age_decay_0.99"}


def run_one(job: tuple[str, int, int, int, int]) -> dict:
    """One training run in a worker process (one torch thread); returns its figures."""
    import torch

    from unipg.config import load_config
    from unipg.runtime.gym import train_gym

    objective, eta, seed, total_steps, eval_every = job
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as output_dir:
        config = load_config(
            CONFIG,
            [
                f"seed={seed}",
                f"env.total_steps={total_steps}",
                f"eval.every_steps={eval_every}",
                "runtime.schedule=sequential",
                f"runtime.max_staleness={eta}",
                f"log.output_dir={output_dir}",
                "log.progress=false",
                "log.tensorboard=false",
                "log.log_every_updates=50",
                *OBJECTIVES[objective],
            ],
        )
        result = train_gym(config, return_threshold=THRESHOLD)
    return {
        "objective": objective,
        "eta": eta,
        "seed": seed,
        "steps_to_475": result.steps_to_eval_threshold,
        "final_return": result.final_eval_mean,
        "wall_seconds": result.wall_seconds,
    }


def mean_std(values: list[float], digits: int = 0) -> str:
    if not values:
        return "—"
    std = statistics.pstdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):,.{digits}f} ± {std:,.{digits}f}"


def cell_values(results: list[dict], objective: str, eta: int) -> tuple[list[float], list[float], int]:
    runs = [r for r in results if r["objective"] == objective and r["eta"] == eta]
    steps = [r["steps_to_475"] for r in runs if r["steps_to_475"] is not None]
    return steps, [r["final_return"] for r in runs], len(runs)


def markdown(results: list[dict], objectives: list[str], etas: list[int]) -> str:
    """Two tables (steps to 475, final return), objectives × η, and each cell's change relative to η = 0."""
    header = "| objective | " + " | ".join(f"η={eta}" for eta in etas) + " |"
    rule = "|---|" + "---:|" * len(etas)

    def table(column: int, cell) -> list[str]:
        """One row per objective; ``cell(values, runs, change)`` formats the values of ``cell_values``'s column."""
        lines = [header, rule]
        for objective in objectives:
            reference = statistics.fmean(cell_values(results, objective, etas[0])[column] or [float("nan")])
            cells = []
            for eta in etas:
                cell_data = cell_values(results, objective, eta)
                values, runs = cell_data[column], cell_data[2]
                change = statistics.fmean(values) / reference - 1 if values and eta != etas[0] else None
                cells.append(cell(values, runs, change))
            lines.append(f"| {objective} | " + " | ".join(cells) + " |")
        return lines

    steps = table(
        0,
        lambda values, runs, change: (
            f"{mean_std(values)} ({len(values)}/{runs}" + (f", {change:+.0%}" if change is not None else "") + ")"
        ),
    )
    finals = table(
        1, lambda values, runs, change: mean_std(values, 1) + (f" ({change:+.1%})" if change is not None else "")
    )
    return "\n".join(
        [
            f"Environment steps until eval return ≥ {THRESHOLD:.0f} (mean ± std over the seeds that "
            "reached it; reached/seeds; change vs η=0 of the same objective):",
            "",
            *steps,
            "",
            "Final evaluation return (mean ± std; change vs η=0 of the same objective):",
            "",
            *finals,
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--etas", nargs="+", type=int, default=[0, 1, 2, 4, 8])
    parser.add_argument("--objectives", nargs="+", default=DEFAULT_OBJECTIVES, choices=list(OBJECTIVES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, each in its own process, one thread each")
    parser.add_argument("--total-steps", type=int, default=100_000, help="environment steps per run")
    parser.add_argument("--eval-every", type=int, default=5_000, help="environment steps between evaluations")
    parser.add_argument("--out", type=Path, help="also write every run's figures to this JSON file")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, a few seconds: checks that the script still runs, measures nothing",
    )
    args = parser.parse_args()
    if args.smoke:
        args.etas, args.objectives, args.seeds = [0, 1], ["naive_ppo", "decoupled_ppo"], [0]
        args.jobs, args.total_steps, args.eval_every = 1, 1_024, 512

    objectives = list(args.objectives)
    if 0 in args.etas and "naive_ppo" not in objectives and SAME_AS_NAIVE_WHEN_FRESH & set(objectives):
        objectives.insert(0, "naive_ppo")  # run once, stands in for the others at η = 0
    jobs = [
        (objective, eta, seed, args.total_steps, args.eval_every)
        for objective in objectives
        for eta in args.etas
        for seed in args.seeds
        if not (eta == 0 and objective in SAME_AS_NAIVE_WHEN_FRESH)
    ]
    start, results = time.time(), []
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        for result in pool.imap_unordered(run_one, jobs):
            results.append(result)
            print(
                f"[{len(results)}/{len(jobs)} {time.time() - start:.0f}s] {result['objective']} η={result['eta']} "
                f"seed {result['seed']}: 475 at {result['steps_to_475']}, final {result['final_return']:.1f} "
                f"({result['wall_seconds']:.0f}s)",
                flush=True,
            )
    results += [
        dict(r, objective=objective)
        for objective in objectives
        if objective in SAME_AS_NAIVE_WHEN_FRESH
        for r in list(results)
        if r["objective"] == "naive_ppo" and r["eta"] == 0
    ]
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    print()
    print(markdown(results, objectives, args.etas))
    print(f"\n{len(jobs)} runs, {args.jobs} at a time, {time.time() - start:.0f}s wall")


if __name__ == "__main__":
    main()
