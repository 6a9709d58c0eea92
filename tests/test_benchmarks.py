"""Every script in benchmarks/ still runs: its ``--smoke`` mode (tiny sizes, seconds, no network) in a subprocess
exits 0 and prints its table or figure lines. Every side of a comparison runs, peers included (TRL's
GRPOTrainer, Stable-Baselines3's PPO, the Ray backend, chaos.py's SIGKILL phase): the lines checked are the
ones printed only when that side ran, and a peer that is not installed fails the script."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# script -> lines its smoke report prints, each in full or in part
REPORTS = {
    "async_vs_sync.py": ("| run | steps wall-clock (s) | trajectories/s |",),
    "chaos.py": (
        "| phase | survived | faults injected |",
        "| inprocess | yes |",
        "inprocess met calls that never end",
        "and finished: yes",
        "sigkill: 1 SIGKILLs over 2 runs; final weights equal to the uninterrupted run bit for bit: yes",
    ),
    "copying.py": ("| result length | problems | result copied |",),
    "classic_control.py": ("CartPole-v1: steps to deterministic eval mean",),
    "engines.py": ("vllm / hf tokens/s:",),
    "estimators.py": ("| preset | pass@1 before → after |", "| grpo | ", "| gspo | ", "2 runs, one at a time,"),
    "endpoint.py": ("| agent | episodes/s | vs built-in | completion rate |",),
    "learner.py": ("packed / padded tokens/s:",),
    "peer_ppo.py": ("sb3    seed 0:", "unipg/sb3 = "),
    "ray_scaling.py": ("| inprocess | 1 |", "| ray | 1 |", "Ray overhead at 1 worker vs in-process:"),
    "same_metrics.py": ("values compared, same",),
    "soak.py": ("RSS trend over the second half:",),
    "staleness_ablation.py": ("runs, 1 at a time,",),
    "threads.py": ("threads, batch",),
    "vs_trl.py": ("seed 0: training with trl ...", "samples/s ratio unipg / TRL:"),
}
# the scripts whose smoke run trains (train_lm, train_gym or unipg.train): e2e
TRAINS = {
    "async_vs_sync.py",
    "chaos.py",
    "classic_control.py",
    "estimators.py",
    "peer_ppo.py",
    "same_metrics.py",
    "soak.py",
    "staleness_ablation.py",
    "vs_trl.py",
}


def test_every_benchmark_script_has_a_smoke_run():
    assert sorted(path.name for path in (ROOT / "benchmarks").glob("*.py")) == sorted(REPORTS)


@pytest.mark.parametrize(
    "script",
    [pytest.param(script, marks=pytest.mark.e2e) if script in TRAINS else script for script in sorted(REPORTS)],
)
def test_a_benchmark_script_runs_in_its_smoke_mode(script, embedded_path, tmp_path):
    """``embedded_path``: the embedded model is built once, in the cache the scripts inherit."""
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--smoke"],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    for line in REPORTS[script]:
        assert line in done.stdout, f"{line!r} not printed:\n{done.stdout[-3000:]}"
