"""No decision of a run reads the test split: the warm start's evidence stop and the choice of the best checkpoint
read the validation split, and only the report evaluation (``eval/…``) reads test examples."""

from __future__ import annotations

import json
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

import unipg.runtime.lm as lm_runtime
from tests.helpers.configs import CALCULATOR_AGENT
from unipg.checkpoint.files import read_manifest
from unipg.config import load_config
from unipg.config.yaml_file import read_yaml
from unipg.learn.warm_start import MARKER
from unipg.observe.metrics import read_metrics
from unipg.tasks.base import TASKS, Example


class Reads:
    """Where test examples were read: inside the report evaluation (counted) or anywhere else (the stack)."""

    reporting = False
    in_report = 0
    elsewhere: list[str] = []


@dataclass(frozen=True)
class WatchedExample(Example):
    """A test example that records every read of its fields."""

    def __getattribute__(self, name):
        if name in ("prompt", "answer", "solution", "columns"):
            if Reads.reporting:
                Reads.in_report += 1
            else:
                frames = [f for f in traceback.extract_stack()[:-1] if "/unipg/" in f.filename]
                Reads.elsewhere.append(" <- ".join(f"{Path(f.filename).name}:{f.name}" for f in reversed(frames[-4:])))
        return object.__getattribute__(self, name)


@pytest.fixture
def watched_report(monkeypatch):
    """``report_evaluation``, the one reader of the test split a run has, marked as such while it runs."""
    report = lm_runtime.report_evaluation

    def marked(*args, **kwargs):
        Reads.reporting = True
        try:
            return report(*args, **kwargs)
        finally:
            Reads.reporting = False

    monkeypatch.setattr(lm_runtime, "report_evaluation", marked)
    monkeypatch.setattr(Reads, "elsewhere", [])
    monkeypatch.setattr(Reads, "in_report", 0)


def test_the_evidence_stop_and_the_best_checkpoint_never_read_a_test_example(embedded_path, tmp_path, watched_report):
    config = load_config(
        None,
        CALCULATOR_AGENT
        + [
            "task.options={digits: 2, num_train: 40, num_test: 4, tool_demonstrations: 1.0, data_seed: 5}",
            "task.tools=[{name: calculator}]",
            "model.warm_start=true",
            "sft.steps=3",
            "sft.batch_size=4",
            "sft.evidence_stop=all",
            "sft.evidence_every=2",
            "sft.evidence_examples=4",
            "eval.every_updates=1",
            "eval.transcripts=1",
            "checkpoint.every_updates=1",
            "checkpoint.keep_last=1",
            "train.updates=2",
            f"log.output_dir={tmp_path}",
        ],
    )
    assert config.checkpoint.keep_best and config.checkpoint.best_metric == "val/pass@1"
    built = TASKS.get("calculator")(digits=2, num_train=40, num_test=4, tool_demonstrations=1.0, data_seed=5)
    assert built.validation is None  # as a plugin's task comes: the run carves its validation split
    test = [WatchedExample(e.prompt, e.answer, e.solution, e.columns) for e in built.test]
    result = lm_runtime.train_lm(config, task=replace(built, test=test), log=lambda text: None)

    assert Reads.elsewhere == [], "test examples read outside the report:\n" + "\n".join(Reads.elsewhere[:10])
    assert Reads.in_report > 0  # the report did read them: the watch works
    records = read_metrics(result.run_dir)
    evaluated = {record["step"]: record for record in records if "eval/pass@1" in record}
    assert sorted(evaluated) == [0, 1, 2]
    assert "val/pass@1" not in evaluated[0]  # before training no decision needs it
    assert all("val/pass@1" in evaluated[update] and "val/turns" in evaluated[update] for update in (1, 2))
    kept = sorted((result.run_dir / "checkpoints").glob("step-*"))
    assert kept and all("val/pass@1" in read_manifest(path)["metrics"] for path in kept)
    warm_start = Path(read_yaml(result.run_dir / "config.yaml")["model"]["name"])
    evidence = json.loads((warm_start / MARKER).read_text())["final"]["evidence"]
    assert [entry["step"] for entry in evidence] == [2]  # measured, on the validation split
