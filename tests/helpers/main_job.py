"""The README's main job, run by the CLI in a background process while the rest of the test session runs.

The main job takes minutes on one core; most tests keep only about one of a machine's two cores busy, so the
session starts the job as soon as collection selects its acceptance test (``tests/conftest.py``) and the test,
moved to the end of the session, waits for the process to exit. The job runs with ``threads=1`` and its own
cache folder, so its warm start is built in this session, never read from an earlier one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAIN_JOB = ROOT / "configs" / "calculator_agent.yaml"
MARKER = "main_job"  # the marker of the test that waits for the run


@dataclass
class MainJobRun:
    """A running (or finished) ``unipg train --config configs/calculator_agent.yaml``."""

    folder: Path
    process: subprocess.Popen

    @property
    def run_dir(self) -> Path:
        return self.folder / "run"

    @property
    def log(self) -> Path:
        return self.folder / "train.log"

    @classmethod
    def start(cls) -> MainJobRun:
        folder = Path(tempfile.mkdtemp(prefix="unipg-main-job-"))
        command = [
            *(sys.executable, "-m", "unipg.cli", "train", "--config", str(MAIN_JOB)),
            *("threads=1", f"log.output_dir={folder}", "log.run_name=run", "log.progress=false"),
        ]
        environment = {**os.environ, "UNIPG_CACHE": str(folder / "cache")}
        with open(folder / "train.log", "wb") as log:
            process = subprocess.Popen(
                command, cwd=ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return cls(folder, process)

    def wait(self, timeout: float) -> int:
        """The exit status, once the run has ended (``subprocess.TimeoutExpired`` after ``timeout`` seconds)."""
        return self.process.wait(timeout=timeout)

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def evaluations(self) -> list[dict]:
        """The records of metrics.jsonl that hold a held-out evaluation, in order (the first is before training)."""
        records = [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]
        return [record for record in records if "eval/pass@1" in record]

    def stop(self) -> None:
        """End the run if it still runs (the session was interrupted) and remove its folder."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)
