"""Acceptance: CartPole-v1 (slow: minutes per run; `pytest -m slow`) and the README's main job (in the default
run, in a background process from the start of the session)."""

import pytest

from unipg.config import load_config
from unipg.observe.doctor import diagnose_run
from unipg.runtime.gym import train_gym

pytestmark = pytest.mark.e2e


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("algorithm", ["ppo", "trpo"])
def test_reaches_475_within_100k_steps(tmp_path, algorithm, seed):
    config = load_config(
        None,
        [
            f"algorithm={algorithm}",
            f"seed={seed}",
            "env.total_steps=100000",
            "eval.episodes=20",
            f"log.output_dir={tmp_path}",
            "log.progress=false",
            "log.tensorboard=false",
        ],
    )
    result = train_gym(config)
    assert result.final_eval_mean >= 475, result.eval_history


@pytest.mark.main_job
def test_the_main_job_lifts_sampled_and_greedy_completion_from_guessing(main_job_run):
    """configs/calculator_agent.yaml by the CLI as the README runs it (with threads=1), its warm start built in this
    session (tests/helpers/main_job.py). Before RL, greedy and sampled episodes both mostly answer without the tool
    and neither held-out completion rate exceeds 0.15; RL lifts both by at least 0.40; and the doctor, reading the
    run's metrics, sees convergence on the tool call, not mode collapse."""
    status = main_job_run.wait(timeout=60 * 60)
    assert status == 0, main_job_run.tail()
    evaluations = main_job_run.evaluations()
    before, after = evaluations[0], evaluations[-1]
    summary = f"before {before}\nafter {after}\n{main_job_run.tail(12)}"
    for key in ("eval/pass@1", "eval/sampled_completion"):
        assert before[key] <= 0.15, summary
        assert after[key] - before[key] >= 0.40, summary
    assert after["eval/tool_calls"] >= 0.9, summary
    findings = {finding.check for finding in diagnose_run(main_job_run.run_dir)}
    assert "low_diversity" not in findings, summary
