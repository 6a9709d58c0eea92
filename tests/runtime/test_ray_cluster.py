"""The multi-node cases run in an interpreter of their own (``ray_cluster_cases.py``: two real Ray nodes on
127.0.0.1; ``ray_node_loss_cases.py``: a node lost mid-run; ``ray_job_cases.py``: a run submitted with `ray job
submit`), without the ``RAY_*`` variables of this process's environment: a local Ray instance started earlier in it
(another test module's ``ray.init``) leaves settings there (token authentication, which the nodes of the cluster
do not use) that ``ray.shutdown`` does not take back, and under them the actors a loopback cluster is asked for never
start. A run that joins a cluster starts as that fresh interpreter does."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]
CASES = ["tests/runtime/ray_cluster_cases.py", "tests/runtime/ray_node_loss_cases.py", "tests/runtime/ray_job_cases.py"]
GUARD_SECONDS = 900  # only a failure guard: the cases take about three minutes


def test_the_multi_node_cases_pass_in_an_interpreter_of_their_own():
    cases = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CASES],
        cwd=ROOT,
        env={name: value for name, value in os.environ.items() if not name.startswith("RAY_")},
        capture_output=True,
        text=True,
        timeout=GUARD_SECONDS,
    )
    assert cases.returncode == 0, cases.stdout[-8000:] + cases.stderr[-2000:]
    assert " passed" in cases.stdout.splitlines()[-1]
