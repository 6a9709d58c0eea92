"""Classic-control benchmark: REINFORCE, A2C, PPO and TRPO on CartPole-v1, several seeds.

Prints, per algorithm and seed: environment steps until the deterministic evaluation mean (20 episodes,
every 5,000 steps) first reaches 475; environment steps until the last 100 training episodes (stochastic
policy) average 475; the final deterministic evaluation return over 20 episodes; and environment steps
per second (rollout + learning + evaluation, one process, one thread).

    python benchmarks/classic_control.py                 # all four algorithms, seeds 0 1 2
    python benchmarks/classic_control.py --algorithms ppo trpo --seeds 0
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from rich.console import Console
from rich.table import Table

from unipg.config import load_config
from unipg.runtime.gym import train_gym

BUDGETS = {"ppo": 100_000, "trpo": 100_000, "a2c": 500_000, "reinforce": 500_000}
THRESHOLD = 475.0


def run(algorithm: str, seed: int, output_dir: str, eval_every: int, budget: int):
    config = load_config(
        None,
        [
            f"algorithm={algorithm}",
            f"seed={seed}",
            f"env.total_steps={budget}",
            f"eval.every_steps={eval_every}",
            "eval.episodes=20",
            f"log.output_dir={output_dir}",
            "log.progress=false",
            "log.tensorboard=false",
            "log.log_every_updates=10",
        ],
    )
    return train_gym(config, return_threshold=THRESHOLD)


def reached(steps: int | None) -> str:
    return f"{steps:,}" if steps else "not reached"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", nargs="+", default=list(BUDGETS), choices=list(BUDGETS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--eval-every", type=int, default=5_000, help="environment steps between evaluations")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, a few seconds: checks that the script still runs, measures nothing",
    )
    args = parser.parse_args()
    budgets = {algorithm: 4_096 for algorithm in BUDGETS} if args.smoke else BUDGETS  # PPO collects 4,000 a batch
    if args.smoke:
        args.algorithms, args.seeds, args.eval_every = ["ppo"], [0], 2_048

    table = Table(title=f"CartPole-v1: steps to deterministic eval mean ≥ {THRESHOLD:.0f}, final eval (20 episodes)")
    for column in (
        "algorithm",
        "budget",
        "seed",
        "eval ≥475 at",
        "train (100 ep.) ≥475 at",
        "final eval return",
        "env steps/s",
        "wall s",
    ):
        table.add_column(column, justify="right")
    with tempfile.TemporaryDirectory() as output_dir:
        for algorithm in args.algorithms:
            finals = []
            for seed in args.seeds:
                result = run(algorithm, seed, output_dir, args.eval_every, budgets[algorithm])
                finals.append(result.final_eval_mean)
                table.add_row(
                    algorithm,
                    f"{budgets[algorithm]:,}",
                    str(seed),
                    reached(result.steps_to_eval_threshold),
                    reached(result.steps_to_train_threshold),
                    f"{result.final_eval_mean:.1f} ± {result.final_eval_std:.1f}",
                    f"{result.steps_per_second:,.0f}",
                    f"{result.wall_seconds:.0f}",
                )
            table.add_row(algorithm, "", "mean", "", "", f"{statistics.fmean(finals):.1f}", "", "", end_section=True)
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
