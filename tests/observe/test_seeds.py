import json

import pytest
from typer.testing import CliRunner

from tests.helpers.configs import TWO_EVALUATED_UPDATES
from unipg.cli import app
from unipg.observe.seeds import aggregate, final_metrics, write_seed_summary


def write_run(run_dir, records):
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return run_dir


def test_final_metrics_take_each_metrics_last_value(tmp_path):
    run = write_run(
        tmp_path / "a",
        [
            {"step": 0, "time": 0.1, "eval/pass@1": 0.1},
            {"step": 1, "time": 0.2, "train/loss": 2.0},
            {"step": 2, "time": 0.3, "eval/pass@1": 0.4, "train/loss": None},
        ],
    )
    assert final_metrics(run) == {"eval/pass@1": 0.4, "train/loss": 2.0}


def test_aggregate_is_mean_and_std_over_the_metrics_every_seed_logged(tmp_path):
    runs = [
        write_run(tmp_path / "a", [{"step": 1, "eval/pass@1": 0.2, "only/a": 1.0}]),
        write_run(tmp_path / "b", [{"step": 1, "eval/pass@1": 0.6}]),
    ]
    summary = aggregate(runs)
    assert set(summary) == {"eval/pass@1"}
    assert summary["eval/pass@1"]["values"] == [0.2, 0.6]
    assert abs(summary["eval/pass@1"]["mean"] - 0.4) < 1e-12 and abs(summary["eval/pass@1"]["std"] - 0.2) < 1e-12
    path = write_seed_summary(tmp_path / "out", "grpo-x", [0, 1], runs)
    assert json.loads(path.read_text())["final"]["eval/pass@1"]["mean"] == summary["eval/pass@1"]["mean"]
    assert "| eval/pass@1 | 0.4 ± 0.2 | 0.2, 0.6 |" in path.with_suffix(".md").read_text()


@pytest.mark.e2e
def test_cli_seeds_writes_the_aggregate(embedded_path, tmp_path):
    result = CliRunner().invoke(
        app,
        [
            "train",
            *TWO_EVALUATED_UPDATES,
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
            "train.updates=1",
            "--seeds",
            "0,1",
        ],
    )
    assert result.exit_code == 0, result.output
    summaries = list(tmp_path.glob("*-seeds-0-1-*.json"))
    assert len(summaries) == 1
    final = json.loads(summaries[0].read_text())["final"]
    assert len(final["eval/pass@1"]["values"]) == 2


@pytest.mark.e2e
def test_cli_seeds_in_parallel_processes_give_the_sequential_results(embedded_path, tmp_path):
    common = [
        "train",
        *TWO_EVALUATED_UPDATES,
        f"model.name={embedded_path}",
        "train.updates=1",
        "deterministic=true",
        "--seeds",
        "0,1",
    ]
    finals = []
    for jobs in ("1", "2"):
        output = tmp_path / jobs
        result = CliRunner().invoke(app, [*common, f"log.output_dir={output}", "--jobs", jobs])
        assert result.exit_code == 0, result.output
        summary = json.loads(next(output.glob("*-seeds-0-1-*.json")).read_text())["final"]
        finals.append(
            {
                key: entry["values"]
                for key, entry in summary.items()
                if not key.startswith(("timing/", "system/")) and not key.endswith("seconds")
            }
        )
    assert finals[0] == finals[1]
