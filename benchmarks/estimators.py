"""Which estimator when, measured: every text algorithm preset trained on one task under one sample budget.

Each preset (``unipg algorithms``, the text ones) trains the same warm-started embedded model on the same task
for the same number of updates × batch size, with the same seeds. What the runs share comes from the task's
config (``configs/arithmetic_grpo.yaml``, or ``configs/calculator_agent.yaml`` with ``--task calculator``): the
task and its options, the model and its cached warm start, the generation length and temperature, the learning
rate and its schedule, gradient clipping and micro-batch size. What sets the algorithms apart comes from their
presets and overrides the config: the estimator section (advantage, policy loss, clip, KL coefficient and where
it goes, loss aggregation), ``samples_per_prompt``, dynamic sampling, the value head, the number of epochs, and
the number of optimizer steps per batch (the preset's ``batch_size / mini_batch_size``, kept at this batch size).
The presets' own learning rate (1e-6, sized for large pretrained models) would leave the small embedded model
where it started within a short budget, so every run uses the config's instead.

Every run holds a frozen copy of the starting model (``model.reference=copy``), so that the KL to it is reported
for every preset, also those without a KL term. Reported per preset, mean ± std over seeds, read from each run's
metrics.jsonl: held-out greedy pass@1 before → after training (the test split, which no training decision
reads), the train reward (sampled, mean over the last update's batch), the KL to the reference and the policy's
token entropy on the last update's batch, and the mean wall-clock seconds per update (evaluation excluded; ReMax's
greedy episodes, one per prompt and not trained on, included).

    python benchmarks/estimators.py                      # every text preset, seeds 0 1, 10 updates × 1024
    python benchmarks/estimators.py --presets grpo rloo gspo --seeds 0 1 2 --updates 40
    python benchmarks/estimators.py --task calculator --presets grpo cispo --updates 10   # slow: agent episodes
    python benchmarks/estimators.py --smoke --presets remax   # the smoke run of other presets than grpo and gspo
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TASKS = {"arithmetic": CONFIGS / "arithmetic_grpo.yaml", "calculator": CONFIGS / "calculator_agent.yaml"}
# Preset keys that stay as the task's config sets them: they belong to the task or to the shared budget.
SHARED = {
    "train.learning_rate",
    "train.lr_schedule",
    "train.batch_size",
    "train.micro_batch_size",
    "train.max_grad_norm",
    "train.adam_eps",
    "sample.max_new_tokens",
    "sample.temperature",
}
# --smoke: the same code path at tiny sizes, to check that the script still runs (its figures mean nothing)
SMOKE = [
    "task.options={digits: 1, num_train: 16, num_test: 4}",
    "model.warm_start=false",
    "sample.max_new_tokens=4",
]


def preset_overrides(name: str, batch_size: int) -> list[str]:
    """The preset's own settings as ``key=value`` overrides, with its optimizer steps per batch kept at
    ``batch_size``; the keys in ``SHARED`` are left to the task's config."""
    from unipg.config.presets import ALGORITHMS

    preset = ALGORITHMS[name].preset_for(True)
    steps_per_batch = preset["train"]["batch_size"] // preset["train"]["mini_batch_size"]
    overrides = [f"algorithm={name}", f"train.mini_batch_size={batch_size // steps_per_batch}"]
    for section, values in preset.items():
        for key, value in values.items():
            dotted = f"{section}.{key}"
            if dotted not in SHARED and dotted != "train.mini_batch_size":
                overrides.append(f"{dotted}={json.dumps(value)}")
    return overrides


def run_one(job: tuple[str, int, dict]) -> dict:
    """One training run in a fresh worker process (one torch thread); its figures from metrics.jsonl."""
    import torch

    import unipg
    from unipg.observe.metrics import read_metrics

    preset, seed, options = job
    torch.set_num_threads(1)
    batch_size, updates = options["batch_size"], options["updates"]
    # one micro-batch size for every preset (the smallest mini-batch is a quarter of the batch), so that seconds
    # per update compare the estimators and not the memory layout
    micro = min(options["micro_batch_size"], batch_size // 4)
    with tempfile.TemporaryDirectory() as output_dir:
        overrides = [
            *preset_overrides(preset, batch_size),
            f"seed={seed}",
            f"train.batch_size={batch_size}",
            f"train.updates={updates}",
            f"train.micro_batch_size={micro}",
            "model.reference=copy",
            f"eval.every_updates={updates}",
            f"eval.max_examples={options['eval_examples']}",
            "eval.pass_k=0",
            f"log.output_dir={output_dir}",
            "log.progress=false",
            "log.tensorboard=false",
            "log.monitor=false",
            "checkpoint.every_updates=0",
            *options["extra"],
        ]
        try:
            result = unipg.train(TASKS[options["task"]], overrides=overrides)
        except Exception as error:  # a preset that fails is a finding of its own: report it, run the others
            return {"preset": preset, "seed": seed, "error": f"{type(error).__name__}: {error}"[:200]}
        records = read_metrics(result.run_dir)
    evaluations = [r for r in records if "eval/pass@1" in r]
    steps = [r for r in records if "timing/step" in r]
    last = steps[-1]
    return {
        "preset": preset,
        "seed": seed,
        "pass1_before": evaluations[0]["eval/pass@1"],
        "pass1_after": evaluations[-1]["eval/pass@1"],
        "reward": last["rollout/reward_mean"],
        "kl": last.get("train/kl_to_reference", float("nan")),
        "entropy": last.get("train/entropy", float("nan")),
        "seconds_per_update": statistics.fmean(r["timing/step"] for r in steps),
    }


def mean_std(values: list[float], digits: int = 3) -> str:
    std = statistics.pstdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.{digits}f} ± {std:.{digits}f}"


def markdown(results: list[dict], presets: list[str]) -> str:
    """One row per preset, each cell mean ± std over its seeds."""
    lines = [
        "| preset | pass@1 before → after | final train reward | KL to reference | entropy | s/update |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for preset in presets:
        runs = [r for r in results if r["preset"] == preset and "error" not in r]
        failed = [r for r in results if r["preset"] == preset and "error" in r]
        if failed:
            lines.append(f"| {preset} | failed on seed {failed[0]['seed']}: {failed[0]['error']} | | | | |")
        if not runs:
            continue

        def column(key: str) -> list[float]:
            return [r[key] for r in runs]  # noqa: B023 - used within this iteration only

        lines.append(
            f"| {preset} | {mean_std(column('pass1_before'))} → {mean_std(column('pass1_after'))} "
            f"| {mean_std(column('reward'))} | {mean_std(column('kl'), 4)} | {mean_std(column('entropy'))} "
            f"| {mean_std(column('seconds_per_update'), 2)} |"
        )
    return "\n".join(lines)


def main() -> None:
    from unipg.config.presets import lm_algorithm_names

    text_presets = lm_algorithm_names()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--presets", nargs="+", choices=text_presets, help="default: every text preset (with --smoke: grpo gspo)"
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--updates", type=int, default=10, help="learner updates per run")
    parser.add_argument("--batch-size", type=int, default=1024, help="completions per update (every preset)")
    parser.add_argument("--task", choices=sorted(TASKS), default="arithmetic", help="whose config the runs share")
    parser.add_argument("--eval-examples", type=int, default=200, help="held-out problems of each evaluation")
    parser.add_argument("--out", type=Path, help="also write every run's figures to this JSON file")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="grpo and gspo (or --presets), one seed, two updates of a tiny task: checks that the script still runs, "
        "measures nothing",
    )
    args = parser.parse_args()
    extra = []
    if args.smoke:
        args.presets = args.presets or ["grpo", "gspo"]
        args.seeds, args.updates, args.batch_size, args.eval_examples = [0], 2, 16, 4
        extra = SMOKE
    args.presets = args.presets or text_presets
    options = {
        "task": args.task,
        "batch_size": args.batch_size,
        "updates": args.updates,
        "micro_batch_size": 128,
        "eval_examples": args.eval_examples,
        "extra": extra,
    }
    if args.batch_size % 8:
        # up to four optimizer steps per batch (a preset's mini-batch) and groups of samples_per_prompt (8)
        parser.error(f"--batch-size must be a multiple of 8 (got {args.batch_size})")
    jobs = [(preset, seed, options) for preset in args.presets for seed in args.seeds]
    print(
        f"{args.task}: {len(args.presets)} presets × {len(args.seeds)} seeds, {args.updates} updates × "
        f"{args.batch_size} completions each",
        flush=True,
    )
    start, results = time.time(), []
    # one run at a time, each in a fresh process: no state carries over from one run to the next
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        for result in pool.imap(run_one, jobs):
            results.append(result)
            if "error" in result:
                print(f"[{len(results)}/{len(jobs)}] {result['preset']} seed {result['seed']}: {result['error']}")
                continue
            print(
                f"[{len(results)}/{len(jobs)} {time.time() - start:.0f}s] {result['preset']} seed {result['seed']}: "
                f"pass@1 {result['pass1_before']:.3f} → {result['pass1_after']:.3f}, reward {result['reward']:.3f}, "
                f"{result['seconds_per_update']:.2f} s/update",
                flush=True,
            )
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    print()
    print(markdown(results, args.presets))
    print(f"\n{len(jobs)} runs, one at a time, {time.time() - start:.0f}s wall")
    if any("error" in r for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
