"""A run submitted as a Ray job, as README.md's multi-machine section documents it: `ray job submit -- unipg train ...
--backend ray ray.address=auto` to the job server of a cluster of two real nodes on 127.0.0.1 (the head serves the
dashboard there; tests/helpers/ray_cluster.py), the rollout worker on the second node. The job server needs the
packages of ``ray[default]`` (the dashboard's); without them the case is skipped, saying which is missing."""

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers.configs import tiny_lm_overrides
from unipg.observe.metrics import read_metrics

pytest.importorskip("ray")
try:
    import ray.dashboard.optional_deps  # noqa: F401  (what the dashboard and its job server import)
except ImportError as missing:
    pytest.skip(f"`ray job submit` needs the packages of ray[default]: {missing}", allow_module_level=True)
from ray.job_submission import JobStatus, JobSubmissionClient  # noqa: E402

from tests.helpers.ray_cluster import LoopbackCluster, Node  # noqa: E402  (needs Ray)

pytestmark = [
    pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the nodes' processes in /proc"),
    pytest.mark.e2e,
]

BIN = Path(sys.executable).parent  # `ray` and `unipg` of this environment, for this process and the job's
GUARD_SECONDS = 300  # only a failure guard: the job takes about half a minute
POLL_SECONDS = 0.5  # between two looks at the job's status


def ray_command(*arguments: str) -> subprocess.CompletedProcess:
    command = [shutil.which("ray", path=str(BIN)) or "ray", *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=GUARD_SECONDS)


def test_a_run_submitted_with_ray_job_submit_trains_on_the_cluster(embedded_path, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")  # the job runs `unipg` from it
    cluster = LoopbackCluster(Node(1, {"learner": 1}), Node(2, {"rollout": 2}), dashboard=True)
    try:
        cluster.start()
        job = f"unipg-test-{uuid.uuid4().hex[:8]}"
        train = tiny_lm_overrides(
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
            "train.updates=1",
            "checkpoint.every_updates=1",
            "ray.rollout_workers=1",
            "ray.rollout_num_cpus=0.5",
            "ray.rollout_resources={rollout: 1}",
        )
        submitted = ray_command(
            "job", "submit", "--no-wait", "--address", cluster.dashboard_url, "--submission-id", job,
            "--", "unipg", "train", *train, "--backend", "ray", "ray.address=auto",
        )  # fmt: skip
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        jobs = JobSubmissionClient(cluster.dashboard_url)  # the job server's own client, as `ray job status` asks
        deadline = time.monotonic() + GUARD_SECONDS
        while not (status := jobs.get_job_status(job)).is_terminal() and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        assert status == JobStatus.SUCCEEDED, f"{status}\n{jobs.get_job_logs(job)[-6000:]}"
    finally:
        assert cluster.stop() == []
    (run_dir,) = [path.parent for path in tmp_path.glob("*/metrics.jsonl")]
    assert [r["step"] for r in read_metrics(run_dir) if "train/loss" in r] == [1]
    assert (run_dir / "checkpoints" / "step-00000001").is_dir()
