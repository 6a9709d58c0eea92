"""Soak test: the in-process asynchronous runtime with 256 concurrent episodes for 15 minutes, watched for leaks.

Workload: the calculator agent of ``configs/calculator_agent.yaml`` from its warm start trained on tool
demonstrations only, so nearly every episode calls the calculator, whose every call takes a lognormal
``--latency`` seconds: most episodes wait on a tool at any moment, and ``agent.concurrency`` = 256 of them are
in flight (32 groups of 8) on the concurrent schedule with ``runtime.max_staleness`` = 2. The run is the
ordinary ``train_lm`` driver with its metrics, checkpoints (every 10 updates, 3 kept) and evaluation; after
``--minutes`` it is stopped with SIGTERM (the run saves a checkpoint and stops after its update).

Every update logs ``system/rss_mb``, ``system/open_files`` and ``system/threads`` (``process_metrics``); the
report gives them at the first update (after model loading and warm-up) and at the last, the RSS trend over the
second half of the run (least squares, MB per minute), and the episodes in flight. glibc gives each new thread
its own malloc arena, which shows as a slow RSS drift while the tool thread pool fills; the ``unipg`` command caps
the arenas at two (``limit_malloc_arenas``), and so does this benchmark unless ``--default-arenas`` is given.

    python benchmarks/soak.py                 # 15 minutes
    python benchmarks/soak.py --minutes 2     # a quick look
    python benchmarks/soak.py --default-arenas   # with glibc's default number of malloc arenas
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

from unipg.config import load_config
from unipg.observe.metrics import limit_malloc_arenas, read_metrics
from unipg.runtime.lm import TrainingStopped, train_lm

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
    "train.updates=3",
    "eval.every_updates=2",
    "checkpoint.every_updates=2",
]


def slope_per_minute(times: list[float], values: list[float]) -> float:
    """Least-squares slope of ``values`` against ``times`` (seconds), per minute."""
    if len(times) < 2:
        return 0.0
    mean_t, mean_v = statistics.fmean(times), statistics.fmean(values)
    spread = sum((t - mean_t) ** 2 for t in times)
    return 60 * sum((t - mean_t) * (v - mean_v) for t, v in zip(times, values)) / spread if spread else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--concurrency", type=int, default=256, help="episodes in flight")
    parser.add_argument("--latency", type=float, default=1.0, help="median seconds of a tool call")
    parser.add_argument("--default-arenas", action="store_true", help="keep glibc's default malloc arenas")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, a few seconds: checks that the script still runs, measures nothing",
    )
    args = parser.parse_args()
    if args.smoke:  # three updates, not a time limit
        args.concurrency, args.latency = 8, 0.01
    if not args.default_arenas:
        limit_malloc_arenas()
    arenas = os.environ.get("MALLOC_ARENA_MAX")
    print(f"malloc arenas: {f'at most {arenas}' if arenas else 'glibc default'}")
    with tempfile.TemporaryDirectory() as output_dir:
        config = load_config(
            CONFIG,
            [
                "task.options={digits: 3, operations: '*', tool_demonstrations: 1.0}",
                f"task.tools=[{{name: calculator, latency: {{kind: lognormal, seconds: {args.latency}, sigma: 1.0}}}}]",
                f"agent.concurrency={args.concurrency}",
                "runtime.max_staleness=2",
                "runtime.schedule=concurrent",
                "sample.replay_buffer_size=512",
                "train.updates=1000000",
                "eval.every_updates=50",
                "eval.max_examples=64",
                "checkpoint.every_updates=10",
                "checkpoint.keep_last=3",
                f"log.output_dir={output_dir}",
                "log.run_name=soak",
                "log.progress=false",
                *(SMOKE if args.smoke else []),
            ],
        )
        timer = threading.Timer(args.minutes * 60, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        start = time.time()
        try:
            train_lm(config)
        except TrainingStopped:
            pass
        finally:
            timer.cancel()
        seconds = time.time() - start
        records = [r for r in read_metrics(Path(output_dir) / "soak") if "system/rss_mb" in r]
    first, last = records[0], records[-1]
    half = records[len(records) // 2 :]
    trend = slope_per_minute([r["time"] for r in half], [r["system/rss_mb"] for r in half])
    in_flight = statistics.fmean(r["rollout/episodes_in_flight"] for r in records)
    print(
        f"\n{seconds / 60:.1f} minutes, {len(records)} updates, {int(last['train/samples'])} episodes trained on, "
        f"{int(last['rollout/episodes_finished'])} finished; episodes in flight at update ends: mean "
        f"{in_flight:.0f}, max {max(r['rollout/episodes_in_flight'] for r in records):.0f}"
    )
    print("| | first update | last update |")
    print("|---|---|---|")
    for name, unit in (
        ("system/rss_mb", " MB"),
        ("system/open_files", ""),
        ("system/threads", ""),
        ("system/python_threads", ""),
    ):
        print(f"| {name} | {first[name]:.0f}{unit} | {last[name]:.0f}{unit} |")
    print(f"RSS trend over the second half: {trend:+.2f} MB/minute")


if __name__ == "__main__":
    main()
