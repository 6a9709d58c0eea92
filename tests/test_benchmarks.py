"""Every script in benchmarks/ still runs: its ``--smoke`` mode (tiny sizes, seconds, no network) in a subprocess
exits 0 and prints its table or figure lines. Every side of a comparison runs, peers included (TRL's
GRPOTrainer, Stable-Baselines3's PPO, the Ray backend, chaos.py's SIGKILL phase): the lines checked are the
ones printed only when that side ran, and a peer that is not installed fails the script."""

import os
import re
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
    "endpoint.py": ("| agent | episodes/s | / built-in | completion rate |",),
    "logits_memory.py": ("| logits_chunk_tokens | peak MB | peak / float32 logits |", "| 16 | "),
    "learner.py": (
        "exponent of seconds per packed micro-batch against budget:",
        "most / least µs per token across spreads:",
        "learner / bare step tokens/s:",
    ),
    "peer_ppo.py": ("sb3    seed 0:", "unipg/sb3 = "),
    "ray_scaling.py": ("| inprocess | 1 |", "| ray | 1 |", "Ray overhead at 1 worker vs in-process:"),
    "same_metrics.py": ("values compared, same",),
    "scale_model.py": ("scale model: ",),
    "soak.py": ("RSS trend over the second half:",),
    "staleness_ablation.py": ("runs, 1 at a time,",),
    "team_vs_solo.py": (
        "| seed | solo pass@1 | team pass@1 |",
        "--pair checker-tool:",
        "--pair agreement:",
        "6 runs, one at a time,",
    ),
    "threads.py": ("threads, batch",),
    "vs_trl.py": ("seed 0: training with trl ...", "samples/s ratio unipg / TRL:"),
}
# scripts whose smoke run has a test of its own below, and is not run again by the generic test
OWN_TESTS = {"scale.py"}
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
    "team_vs_solo.py",
    "vs_trl.py",
}


def test_every_benchmark_script_has_a_smoke_run():
    assert sorted(path.name for path in (ROOT / "benchmarks").glob("*.py")) == sorted([*REPORTS, *OWN_TESTS])


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


# the rehearsal's phases that need no vLLM: vLLM's start-up on the CPU (~25 s a phase on a busy 2-core machine) puts
# the three phases that start it past this suite's minute; they run in ``scale.py --smoke`` itself
SCALE_PHASES = ("learner-update", "fsdp2-2proc", "checkpoint-resume")


def test_the_scale_rehearsal_prints_a_row_with_figures_for_every_phase():
    """``scale.py --smoke``: the 2-layer model of the 0.5B shape family is built in the test cache, and every phase
    prints its row: seconds, a peak resident memory, and its figures (the checkpoint its bytes written)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--smoke", "--phases", ",".join(SCALE_PHASES)],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {}
    for line in done.stdout.splitlines():
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip("|"))]  # "\|" stays in its cell
        if len(cells) == 6 and cells[0] in SCALE_PHASES:
            rows[cells[0]] = cells
    assert sorted(rows) == sorted(SCALE_PHASES), done.stdout
    for name, (_, seconds, peak, _, moved, figure) in rows.items():
        assert float(seconds) > 0 and float(peak.replace(",", "")) > 0, (name, rows[name])
        assert any(character.isdigit() for character in figure), (name, figure)
    assert int(rows["checkpoint-resume"][4].replace(",", "")) > 0
    assert "restored weights equal the saved ones" in rows["checkpoint-resume"][5]


def test_a_failed_scale_phase_is_reported_by_its_last_error_line(monkeypatch):
    """A rank that died shows in its peer's error, before the phase process's own EOFError and later warnings."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from scale import failure_reason

    output = (
        "Traceback (most recent call last):\n"
        "RuntimeError: [pair.cc:537] Read error [127.0.0.1]:18821: Connection reset by peer.\n"
        "EOFError\n"
        "  warnings.warn('resource_tracker: There appear to be %d '\n"
    )
    assert (
        failure_reason(output, 1)
        == "RuntimeError: [pair.cc:537] Read error [127.0.0.1]:18821: Connection reset by peer."
    )
    assert failure_reason("loading\nkilled\n", -9) == "killed"
    assert failure_reason("", -9) == "exit status -9"


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_the_endpoint_benchmark_plays_every_row_on_the_engine_it_is_given(engine, monkeypatch):
    """``endpoint.py --engine``: the shared overrides load, and the config's engine is the one named (the smoke run
    above plays the hf rows; vllm's start-up would add a minute to it)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import argparse

    from endpoint import CONFIG, overrides

    from unipg.config import load_config

    args = argparse.Namespace(engine=engine, smoke=False, embedded=True)
    config = load_config(CONFIG, overrides(args))
    assert config.sample.engine == engine and config.model.warm_start is False
    assert config.task.options["tool_demonstrations"] == 1.0


def test_the_endpoint_benchmark_adds_its_step_cost_to_every_vllm_step(monkeypatch):
    """``endpoint.py --step-ms``: a sleep (the GIL released) before each step of the vllm engine's stepping loop."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import argparse

    import endpoint

    from unipg.inference.vllm_core import StepLoop

    steps, sleeps = [], []
    monkeypatch.setattr(StepLoop, "_step", lambda self: steps.append(self))  # restored after the test
    monkeypatch.setattr(endpoint.time, "sleep", sleeps.append)
    heading = endpoint.add_cost(argparse.Namespace(generation_ms=0.0, step_ms=25.0))
    StepLoop._step("loop")
    assert steps == ["loop"] and sleeps == [0.025]
    assert heading == ", every engine step 25 ms slower (--step-ms)"
