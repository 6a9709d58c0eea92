"""A damaged metrics.jsonl: the doctor, the plots and the seed summary skip what they cannot read, say how much
they skipped, and never crash."""

import json
import random

import pytest
from typer.testing import CliRunner

from unipg.cli import app
from unipg.observe.records import load_metrics
from unipg.observe.seeds import final_metrics

runner = CliRunner()

# Each damaged form, as the text of one line, and how many lines / values it costs (skipped, ignored).
DAMAGED_LINES = {
    "array": ("[1, 2, 3]", 1, 0),
    "scalar": ("42", 1, 0),
    "string": ('"step"', 1, 0),
    "null": ("null", 1, 0),
    "no step": ('{"rollout/reward_mean": 0.5}', 1, 0),
    "step not a number": ('{"step": "7", "rollout/reward_mean": 0.5}', 1, 0),
    "step a boolean": ('{"step": true, "rollout/reward_mean": 0.5}', 1, 0),
    "step fractional": ('{"step": 7.5, "rollout/reward_mean": 0.5}', 1, 0),
    "step NaN": ('{"step": NaN, "rollout/reward_mean": 0.5}', 1, 0),
    "step huge": ('{"step": 1e308, "rollout/reward_mean": 0.5}', 0, 0),
    "deeply nested line": ("[" * 100_000 + "]" * 100_000, 1, 0),
    "deeply nested value": ('{"step": 7, "rollout/reward_mean": ' + "[" * 50 + "]" * 50 + "}", 0, 1),
    "integer past the conversion limit": ('{"step": 7, "rollout/reward_mean": ' + "9" * 5000 + "}", 1, 0),
    "huge integer": ('{"step": 7, "rollout/reward_mean": ' + "9" * 400 + "}", 0, 0),
    "1e308": ('{"step": 7, "rollout/reward_mean": 1e308, "train/entropy": -1e308}', 0, 0),
    "NaN and Infinity literals": ('{"step": 7, "rollout/reward_mean": NaN, "train/entropy": Infinity}', 0, 0),
    "non-numeric values": ('{"step": 7, "rollout/reward_mean": "high", "train/entropy": true, "x": {}}', 0, 3),
    "not JSON": ("step 7 reward 0.5", 1, 0),
    "not UTF-8": (b'\xff\xfe{"step": 7}'.decode("latin-1"), 1, 0),
}


def healthy_lines(steps: int = 40) -> list[str]:
    rng = random.Random(0)
    return [
        json.dumps(
            {
                "step": i,
                "time": float(i),
                "rollout/reward_mean": 0.1 + 0.7 * i / steps + rng.gauss(0, 0.03),
                "train/entropy": 2.0 - 0.5 * i / steps,
                "timing/generate": 0.5,
                "timing/update": 0.4,
                "timing/step": 1.0,
            }
        )
        for i in range(steps)
    ]


def write_run(folder, damaged: str):
    folder.mkdir(parents=True)
    lines = healthy_lines()
    lines.insert(len(lines) // 2, damaged)
    data = "\n".join(lines) + "\n"
    (folder / "metrics.jsonl").write_bytes(data.encode("latin-1") if "\xff" in damaged else data.encode("utf-8"))
    return folder


@pytest.mark.parametrize("form", sorted(DAMAGED_LINES))
def test_a_damaged_line_is_skipped_and_counted(form, tmp_path):
    line, skipped, ignored = DAMAGED_LINES[form]
    loaded = load_metrics(write_run(tmp_path / "run", line))
    assert (loaded.skipped_lines, loaded.ignored_values) == (skipped, ignored)
    assert len(loaded.records) == 40 + (1 - skipped)
    for record in loaded.records:
        assert isinstance(record["step"], int)
        assert all(value is None or isinstance(value, float) for key, value in record.items() if key != "step")


@pytest.mark.parametrize("form", sorted(DAMAGED_LINES))
def test_the_doctor_reads_a_damaged_file_and_says_what_it_skipped(form, tmp_path):
    line, skipped, ignored = DAMAGED_LINES[form]
    run = write_run(tmp_path / "run", line)
    result = runner.invoke(app, ["doctor", str(run)])
    assert result.exit_code == 0, result.output
    assert ("metrics_file" in result.output) == bool(skipped or ignored), result.output
    if skipped:
        assert f"{skipped} malformed line(s) skipped" in result.output
    as_json = runner.invoke(app, ["doctor", str(run), "--json"])
    assert as_json.exit_code == 0 and isinstance(json.loads(as_json.output), list)


@pytest.mark.parametrize("form", sorted(DAMAGED_LINES))
def test_plots_of_a_damaged_file_are_written_and_the_damage_is_reported(form, tmp_path):
    pytest.importorskip("matplotlib")
    line, skipped, ignored = DAMAGED_LINES[form]
    run = write_run(tmp_path / "run", line)
    result = runner.invoke(app, ["plot", str(run), "--out", str(tmp_path / "plots")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "plots" / "reward.png").is_file()
    assert ("malformed line(s) skipped" in result.output) == bool(skipped)


@pytest.mark.parametrize("form", sorted(DAMAGED_LINES))
def test_final_metrics_of_a_damaged_file_are_numbers(form, tmp_path):
    run = write_run(tmp_path / "run", DAMAGED_LINES[form][0])
    final = final_metrics(run)
    assert final["rollout/reward_mean"] == pytest.approx(0.1 + 0.7 * 39 / 40, abs=0.2)


def test_a_file_of_only_damaged_lines_is_a_clear_error_with_exit_2(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('[1]\n42\n{"loss": 1}\n', encoding="utf-8")
    result = runner.invoke(app, ["doctor", str(run)])
    assert result.exit_code == 2 and "3 malformed line(s) skipped" in result.output
    assert "Traceback" not in result.output
    plotted = runner.invoke(app, ["plot", str(run), "--out", str(tmp_path / "plots")])
    assert plotted.exit_code == 2 and "Traceback" not in plotted.output


def test_a_torn_last_line_is_dropped_without_a_warning(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(healthy_lines(5)) + '\n{"step": 5, "rollout/rew', encoding="utf-8")
    loaded = load_metrics(run)
    assert (len(loaded.records), loaded.skipped_lines) == (5, 0)
