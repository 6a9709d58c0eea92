"""A real ``unipg train`` process on the concurrent schedule, several groups in flight, SIGKILLed at seeded
moments and resumed each time: every prompt the sampler draws is trained exactly once, in the run's
episodes.jsonl, and nothing the killed processes wrote is lost."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers.configs import tiny_lm_overrides
from unipg.observe.episodes import EPISODES_FILE, SUPERSEDED_FILE, supersede_episodes_after
from unipg.observe.metrics import read_metrics
from unipg.runtime.prompts import PromptSampler
from unipg.tasks.base import make_task

UPDATES = 15
GROUPS_PER_UPDATE = 2  # train.batch_size 8 / sample.samples_per_prompt 4
KILLS = 3
TASK = {"digits": 2, "num_train": 400, "num_test": 4}


def overrides(embedded_path: str, output_dir: Path) -> list[str]:
    options = ", ".join(f"{key}: {value}" for key, value in TASK.items())
    return tiny_lm_overrides(
        f"model.name={embedded_path}",
        f"task.options={{{options}}}",
        f"log.output_dir={output_dir}",
        "log.run_name=killed",
        "log.episodes=true",
        f"train.updates={UPDATES}",
        "runtime.schedule=concurrent",
        "runtime.max_staleness=2",
        "agent.concurrency=16",  # four groups of four episodes at once
        "checkpoint.every_updates=1",
        "checkpoint.keep_last=2",
        "eval.every_updates=1000",
        "eval.pass_k=0",
    )


def start(arguments: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "unipg.cli", "train", *arguments],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def newest_checkpoint(run_dir: Path) -> int:
    folder = run_dir / "checkpoints"
    steps = [int(path.name.split("-")[1]) for path in folder.glob("step-*")] if folder.is_dir() else []
    return max(steps, default=0)


def kill_after_checkpoint(process: subprocess.Popen, run_dir: Path, step: int, delay: float) -> None:
    """SIGKILL ``process`` ``delay`` seconds after its checkpoint of update ``step`` (or a later one) appears."""
    deadline = time.monotonic() + 180
    while process.poll() is None and newest_checkpoint(run_dir) < step:
        assert time.monotonic() < deadline, f"no checkpoint of update {step} in 180 s"
        time.sleep(0.05)
    time.sleep(delay)  # a seeded moment after it: in a rollout, an update or the next checkpoint's writing
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL, process.stderr.read().decode()[-3000:]


@pytest.mark.e2e
def test_a_concurrent_run_killed_three_times_trains_every_drawn_prompt_exactly_once(embedded_path, tmp_path):
    moments = random.Random(0)
    arguments = overrides(embedded_path, tmp_path)
    run_dir = tmp_path / "killed"
    process = start(arguments)
    written = set()
    for kill in range(KILLS):  # after a seeded update of each third of the run, at a seeded moment
        step = moments.randint(1 + kill * UPDATES // KILLS, (kill + 1) * UPDATES // KILLS - 3)
        kill_after_checkpoint(process, run_dir, step, moments.uniform(0.0, 0.3))
        written |= set(_text(run_dir / EPISODES_FILE).split("\n")[:-1])  # whole lines only
        process = start(["--resume", str(run_dir)])
    assert process.wait(timeout=300) == 0, process.stderr.read().decode()[-3000:]
    kept = set((_text(run_dir / EPISODES_FILE) + _text(run_dir / SUPERSEDED_FILE)).split("\n"))
    assert written and written <= kept  # every record a killed process wrote is still in one of the two files

    records = [json.loads(line) for line in (run_dir / EPISODES_FILE).read_text().splitlines()]
    by_update = Counter(record["update"] for record in records)
    assert sorted(by_update) == list(range(1, UPDATES + 1))
    assert set(by_update.values()) == {GROUPS_PER_UPDATE * 4}  # four samples per prompt
    trained = [record["prompt"] for record in records]
    groups = Counter(trained)
    assert set(groups.values()) == {4}, [prompt for prompt, count in groups.items() if count != 4]
    task = make_task("arithmetic", **TASK)
    in_flight = 3 * GROUPS_PER_UPDATE  # the staleness gate's bound on groups admitted ahead (η = 2)
    drawn = [example.prompt for example in PromptSampler(task.train, 0).next(UPDATES * GROUPS_PER_UPDATE + in_flight)]
    assert len(set(drawn)) == len(drawn)
    assert set(groups) <= set(drawn)  # each trained prompt is one the sampler drew, and only once (above)
    assert [record["step"] for record in read_metrics(run_dir) if "train/loss" in record] == list(range(1, UPDATES + 1))


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_records_after_the_checkpoint_and_a_cut_line_move_aside_and_nothing_is_dropped(tmp_path):
    lines = [json.dumps({"prompt": f"p{update}", "update": update}) + "\n" for update in (1, 2, 3, 3)]
    (tmp_path / EPISODES_FILE).write_text("".join(lines) + '{"prompt": "p4", "upd')
    assert supersede_episodes_after(tmp_path, 2) == 3
    assert (tmp_path / EPISODES_FILE).read_text() == "".join(lines[:2])
    assert (tmp_path / SUPERSEDED_FILE).read_text() == "".join(lines[2:]) + '{"prompt": "p4", "upd\n'
    assert supersede_episodes_after(tmp_path, 2) == 0
