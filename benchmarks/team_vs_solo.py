"""Does a checker help? The solver–checker team against the solver alone, at the same sample budget.

``--pair calculator`` (the default): the solver alone is ``configs/calculator_agent.yaml``; the team is
``configs/solver_checker.yaml`` (the same calculator problems, model, warm-start stages, learning rate and
temperature, plus a checker that sees the solver's proposal, may call the calculator itself, and accepts it or
sends the solver back with a critique). ``--pair checker-tool``: only the checker holds the calculator
(``configs/solver_checker_tool_checker.yaml``) and the solver alone has no tool (``configs/solver_no_tool.yaml``).
``--pair agreement``: the same, with the checker replying with the calculator's result and a proposal equal to it
accepted (``configs/solver_checker_agreement.yaml``).
Both train for the same number of updates × episodes per update with the same seeds, one run at a time, each in
a fresh process. Reported per seed, from each run's metrics.jsonl and episodes.jsonl:

- held-out completion before → after (``eval/pass@1``: greedy episodes on the test split; the team's counts an
  episode only when the checker accepted a correct answer), and the sampled completion rate with ``--pass-k``;
- each role's own metric on the first and the last update's trained (sampled) episodes: the solver's correct
  final proposals; how often the checker accepted, and its last verdict's two kinds of rightness apart (it
  accepted a correct proposal; it critiqued a wrong one).

    python benchmarks/team_vs_solo.py --seeds 0 1 2 --updates 30      # the configs' budget: 30 × 128 episodes
    python benchmarks/team_vs_solo.py --seeds 0 --updates 10 --eval-examples 100
    python benchmarks/team_vs_solo.py --pair checker-tool --seeds 0 1 2   # only the checker holds the calculator
    python benchmarks/team_vs_solo.py --pair agreement --seeds 0 1 2      # ... and the team accepts on agreement
    python benchmarks/team_vs_solo.py --smoke                          # tiny, seconds: checks the script runs
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
# --pair: which team against which solver alone. "calculator": both roles hold the calculator; "checker-tool":
# only the checker does, and the solver alone has no tool; "agreement": that team accepting on agreement
PAIRS = {
    "calculator": {"solo": CONFIGS / "calculator_agent.yaml", "team": CONFIGS / "solver_checker.yaml"},
    "checker-tool": {"solo": CONFIGS / "solver_no_tool.yaml", "team": CONFIGS / "solver_checker_tool_checker.yaml"},
    "agreement": {"solo": CONFIGS / "solver_no_tool.yaml", "team": CONFIGS / "solver_checker_agreement.yaml"},
}
SIDES = ("solo", "team")
# --smoke: the same code path at tiny sizes, to check that the script still runs (its figures mean nothing)
SMOKE = [
    "task.options.digits=2",
    "task.options.num_train=16",
    "task.options.num_test=4",
    "model.warm_start=false",
    "sample.max_new_tokens=8",
    "sample.dynamic_sampling=false",
    "agent.max_total_tokens=48",
    "train.mini_batch_size=8",
    "train.micro_batch_size=8",
]


def role_rates(records: list[dict], agreement: bool = False) -> dict[str, float]:
    """Each role's own metric over episode records (``unipg.sample.episode_records``) of one update: the share
    of solver sides whose last proposal is correct; for a team, the share of checker sides whose last verdict was
    right and the share that accepted (``agreement``: whose last reply's answer equals the proposal's), and the
    share whose last reply holds the right answer."""
    from unipg.tasks.answers import extract_final_answer
    from unipg.tasks.solver_checker import ACCEPT

    def said(record: dict) -> list[str]:
        return [
            m["content"] for m in record["messages"] if m["role"] == "assistant" and "<tool_call>" not in m["content"]
        ]

    def right(text: str | None, answer: str) -> bool:
        return text is not None and extract_final_answer(text) == answer

    solvers = [r for r in records if r.get("role") in (None, "solver")]
    rates = {"solver_correct": statistics.fmean(bool(said(r)) and right(said(r)[-1], r["answer"]) for r in solvers)}
    checkers = [r for r in records if r.get("role") == "checker" and said(r)]
    if checkers:
        proposals = [[m["content"] for m in r["messages"] if m["role"] == "user"][-1] for r in checkers]
        accepted = [
            extract_final_answer(said(r)[-1]) == extract_final_answer(p.rpartition("Proposed:")[2])
            if agreement
            else said(r)[-1].strip().upper().startswith(ACCEPT)
            for p, r in zip(proposals, checkers)
        ]
        rates["checker_answer_right"] = statistics.fmean(right(said(r)[-1], r["answer"]) for r in checkers)
        correct = [right(p.rpartition("Proposed:")[2], r["answer"]) for p, r in zip(proposals, checkers)]
        rates["checker_accepts"] = statistics.fmean(accepted)
        # a checker that never accepts is right on every wrong proposal: its two kinds of verdict apart
        on_correct = [a for a, c in zip(accepted, correct) if c]
        rates["checker_accepts_correct"] = statistics.fmean(on_correct) if on_correct else float("nan")
        on_wrong = [not a for a, c in zip(accepted, correct) if not c]
        rates["checker_rejects_wrong"] = statistics.fmean(on_wrong) if on_wrong else float("nan")
    return rates


def run_one(job: tuple[str, int, dict]) -> dict:
    """One training run in a fresh worker process; its figures from the run folder."""
    import torch

    import unipg
    from unipg.observe.metrics import read_metrics
    from unipg.sample.episode_records import read_episode_records

    side, seed, options = job
    torch.set_num_threads(1)
    updates = options["updates"]
    with tempfile.TemporaryDirectory() as output_dir:
        overrides = [
            f"seed={seed}",
            f"train.updates={updates}",
            f"train.batch_size={options['batch_size']}",
            f"eval.every_updates={updates}",
            f"eval.max_examples={options['eval_examples']}",
            f"eval.pass_k={options['pass_k']}",
            f"log.output_dir={output_dir}",
            "log.episodes=true",
            "log.progress=false",
            "log.tensorboard=false",
            "log.monitor=false",
            "checkpoint.every_updates=0",
            *options["extra"],
        ]
        start = time.time()
        try:
            result = unipg.train(PAIRS[options["pair"]][side], overrides=overrides)
        except Exception as error:  # report it and run the other side
            return {
                "side": side,
                "seed": seed,
                "pair": options["pair"],
                "error": f"{type(error).__name__}: {error}"[:300],
            }
        records = read_metrics(result.run_dir)
        episodes = read_episode_records(result.run_dir / "episodes.jsonl")
    evaluations = [r for r in records if "eval/pass@1" in r]
    first, last = evaluations[0], evaluations[-1]
    agreement = options["pair"] == "agreement"
    return {
        "side": side,
        "seed": seed,
        "pair": options["pair"],
        "before": first["eval/pass@1"],
        "after": last["eval/pass@1"],
        "sampled_before": first.get("eval/sampled_completion"),
        "sampled_after": last.get("eval/sampled_completion"),
        "first_update": role_rates([e for e in episodes if e["update"] == 1], agreement),
        "last_update": role_rates([e for e in episodes if e["update"] == updates], agreement),
        "seconds": time.time() - start,
    }


def cell(run: dict | None, before: str, after: str) -> str:
    if run is None:
        return "–"
    if "error" in run:
        return f"failed: {run['error']}"
    if run[before] is None:
        return "–"
    return f"{run[before]:.3f} → {run[after]:.3f}"


def rate(run: dict | None, key: str) -> str:
    if run is None or "error" in run or key not in run["last_update"]:
        return "–"
    return f"{run['first_update'][key]:.2f} → {run['last_update'][key]:.2f}"


def markdown(results: list[dict], seeds: list[int]) -> str:
    """One row per seed: both sides' held-out completion and each role's own metric (first → last update)."""
    lines = [
        "| seed | solo pass@1 | team pass@1 | solo sampled | team sampled | solo: solver correct "
        "| team: solver correct | team: checker accepts | checker accepts correct | checker rejects wrong "
        "| checker's answer right | solo / team minutes |",
        "|---:|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for seed in seeds:
        solo = next((r for r in results if r["side"] == "solo" and r["seed"] == seed), None)
        team = next((r for r in results if r["side"] == "team" and r["seed"] == seed), None)
        minutes = " / ".join(f"{r['seconds'] / 60:.1f}" if r and "seconds" in r else "–" for r in (solo, team))
        lines.append(
            f"| {seed} | {cell(solo, 'before', 'after')} | {cell(team, 'before', 'after')} "
            f"| {cell(solo, 'sampled_before', 'sampled_after')} | {cell(team, 'sampled_before', 'sampled_after')} "
            f"| {rate(solo, 'solver_correct')} | {rate(team, 'solver_correct')} | {rate(team, 'checker_accepts')} "
            f"| {rate(team, 'checker_accepts_correct')} | {rate(team, 'checker_rejects_wrong')} "
            f"| {rate(team, 'checker_answer_right')} | {minutes} |"
        )
    gains = [
        (team["after"] - solo["after"])
        for seed in seeds
        for solo in results
        for team in results
        if solo["seed"] == team["seed"] == seed and solo["side"] == "solo" and team["side"] == "team"
        if "error" not in solo and "error" not in team
    ]
    if gains:
        lines.append("")
        lines.append(
            f"team − solo held-out pass@1 after training: {statistics.fmean(gains):+.3f} (per seed: "
            + ", ".join(f"{gain:+.3f}" for gain in gains)
            + f"); goal ≥ +0.10 on every seed: {'met' if all(g >= 0.10 for g in gains) else 'not met'}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--updates", type=int, default=30, help="learner updates per run (both sides)")
    parser.add_argument("--batch-size", type=int, default=128, help="episodes per update (both sides)")
    parser.add_argument("--eval-examples", type=int, default=200, help="held-out problems of each evaluation")
    parser.add_argument("--pass-k", type=int, default=0, help="sampled episodes per held-out problem (0: none)")
    parser.add_argument("--pair", choices=sorted(PAIRS), default="calculator", help="which team and solo (PAIRS)")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--out", type=Path, help="also write every run's figures to this JSON file")
    parser.add_argument(
        "--smoke", action="store_true", help="one seed, two tiny updates, every pair: checks the script runs"
    )
    args = parser.parse_args()
    extra = []
    if args.smoke:
        args.seeds, args.updates, args.batch_size, args.eval_examples, args.pass_k = [0], 2, 8, 4, 0
        extra = SMOKE
    options = {
        "updates": args.updates,
        "batch_size": args.batch_size,
        "eval_examples": args.eval_examples,
        "pass_k": args.pass_k,
        "extra": extra,
    }
    pairs = sorted(PAIRS) if args.smoke else [args.pair]  # the smoke run checks every pair
    jobs = [(side, seed, {**options, "pair": pair}) for pair in pairs for seed in args.seeds for side in args.sides]
    print(f"{len(jobs)} runs: {args.updates} updates × {args.batch_size} episodes each, seeds {args.seeds}", flush=True)
    start, results = time.time(), []
    # one run at a time, each in a fresh process: no state carries over from one run to the next
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        for result in pool.imap(run_one, jobs):
            results.append(result)
            summary = result.get("error") or f"pass@1 {result['before']:.3f} → {result['after']:.3f}"
            print(
                f"[{len(results)}/{len(jobs)} {time.time() - start:.0f}s] {result['side']} seed {result['seed']}: "
                f"{summary}",
                flush=True,
            )
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    print()
    for pair in pairs:
        if len(pairs) > 1:
            print(f"--pair {pair}:")
        print(markdown([r for r in results if r["pair"] == pair], args.seeds))
    print(f"\n{len(jobs)} runs, one at a time, {time.time() - start:.0f}s wall")
    if any("error" in r for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
