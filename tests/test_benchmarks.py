"""Every script in benchmarks/ still runs: its ``--smoke`` mode (tiny sizes, seconds, no network, peers that are
not installed skipped) in a subprocess exits 0 and prints its table or figure line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# script -> a line its report always prints
REPORTS = {
    "async_vs_sync.py": "| run | steps wall-clock (s) | trajectories/s |",
    "chaos.py": "| phase | survived | faults injected |",
    "copying.py": "| result length | problems | result copied |",
    "classic_control.py": "CartPole-v1: steps to deterministic eval mean",
    "engines.py": "vllm / hf tokens/s:",
    "endpoint.py": "| agent | episodes/s | vs built-in | completion rate |",
    "learner.py": "packed / padded tokens/s:",
    "peer_ppo.py": "mean wall time: unipg",
    "ray_scaling.py": "| backend | rollout workers | trajectories/s |",
    "same_metrics.py": "values compared, same",
    "soak.py": "RSS trend over the second half:",
    "staleness_ablation.py": "runs, 1 at a time,",
    "threads.py": "threads, batch",
    "vs_trl.py": "framework",
}
# the scripts whose smoke run trains (train_lm, train_gym or unipg.train): e2e
TRAINS = {
    "async_vs_sync.py",
    "chaos.py",
    "classic_control.py",
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
    assert REPORTS[script] in done.stdout, done.stdout[-2000:]
