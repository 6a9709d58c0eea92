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
    "gpu_check.py": ("PASS hf-generate", "summary: 1 PASS, 0 FAIL, 0 SKIP on cpu"),
    "gpu_paths.py": ("PASS hf-generate",),
    "estimators.py": ("| preset | pass@1 before → after |", "| grpo | ", "| gspo | ", "2 runs, one at a time,"),
    "endpoint.py": ("| agent | episodes/s | vs built-in | completion rate |",),
    "logits_memory.py": ("| logits_chunk_tokens | peak MB | peak / float32 logits |", "| 16 | "),
    "learner.py": (
        "exponent of seconds per packed micro-batch against budget:",
        "most / least µs per token across spreads:",
        "learner / bare step tokens/s:",
    ),
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


def run_gpu_check(*args: str, **environment: str) -> subprocess.CompletedProcess:
    """``benchmarks/gpu_check.py`` with ``args``, as the smoke runs above run a script."""
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **environment},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_gpu_check_skips_every_path_without_a_gpu_and_runs_cheap_paths_on_the_cpu(embedded_path):
    """Without a CUDA device every path is a SKIP line and the check exits 0; with ``--device cpu`` the same code
    passes where the mechanism allows (three cheap paths here: each is its own process)."""
    plain = run_gpu_check(CUDA_VISIBLE_DEVICES="")
    assert plain.returncode == 0, plain.stdout + plain.stderr[-3000:]
    *lines, summary = plain.stdout.strip().splitlines()
    assert len(lines) == 8 and all(line.startswith("SKIP ") and line.endswith(" no CUDA device") for line in lines)
    assert summary.startswith("summary: 0 PASS, 0 FAIL, 8 SKIP on cuda")
    cheap = ("hf-generate", "bf16-masters-update", "packed-attention-update")
    on_cpu = run_gpu_check("--device", "cpu", "--only", ",".join(cheap))
    assert on_cpu.returncode == 0, on_cpu.stdout + on_cpu.stderr[-3000:]
    *lines, summary = on_cpu.stdout.strip().splitlines()
    assert [line.split(" ", 2)[:2] for line in lines] == [["PASS", name] for name in cheap], on_cpu.stdout
    assert "float32 masters" in lines[1] and "packed vs padded" in lines[2]
    assert summary.startswith("summary: 3 PASS, 0 FAIL, 0 SKIP on cpu")
