"""benchmarks/estimators.py compares every text preset, ReMax included: its smoke run of a chosen preset, and the
overrides that give a run the preset's own data (one completion and one greedy episode per prompt)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.estimators import preset_overrides

ROOT = Path(__file__).resolve().parents[1]


def test_a_remax_run_of_the_benchmark_samples_one_completion_per_prompt():
    overrides = preset_overrides("remax", 64)
    assert {"algorithm=remax", 'estimator.advantage="remax"', "sample.samples_per_prompt=1"} <= set(overrides)


@pytest.mark.e2e
def test_the_smoke_run_trains_the_presets_it_is_given(embedded_path):
    """``embedded_path``: the embedded model is built once, in the cache the script inherits."""
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "estimators.py"), "--smoke", "--presets", "remax"],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "| remax | " in done.stdout and "1 runs, one at a time," in done.stdout
    assert "| grpo | " not in done.stdout
