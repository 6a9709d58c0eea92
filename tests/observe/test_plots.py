"""Learning-curve plots: valid PNGs per metric group, and seeds of one experiment drawn as a mean with a band."""

import json
import sys

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from unipg.cli import app
from unipg.observe.plots import draw_metric, group_runs, plot_runs

pytest.importorskip("matplotlib")

runner = CliRunner()
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CONFIG = {
    "algorithm": "ppo",
    "seed": 0,
    "env": {"id": "CartPole-v1"},
    "train": {"learning_rate": 3e-4},
    "log": {"output_dir": "runs", "run_name": None},
}


def write_run(root, name, *, seed=0, learning_rate=3e-4, config=True, steps=30):
    """A run folder whose reward is ``seed`` above a shared rising curve."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    records = [
        {
            "step": 512 * i,
            "time": float(i),
            "rollout/episode_return": 20.0 + 5 * i + seed,
            "train/approx_kl": 0.01,
            "train/clip_fraction": 0.1,
            "train/entropy": 0.69 - 0.001 * i,
            "train/grad_norm": None if i == 3 else 0.5,
            "train/learning_rate": learning_rate,
        }
        for i in range(steps)
    ]
    records += [{"step": 512 * i, "time": float(i), "eval/return_mean": 30.0 + 6 * i} for i in range(0, steps, 5)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    if config:
        run_config = {
            **CONFIG,
            "seed": seed,
            "train": {"learning_rate": learning_rate},
            "log": {"output_dir": str(root), "run_name": name},
        }
        (run_dir / "config.yaml").write_text(yaml.safe_dump(run_config))
    return run_dir


@pytest.fixture
def runs(tmp_path):
    seeds = [write_run(tmp_path, f"ppo-CartPole-v1-seed{seed}-20250101-12000{seed}", seed=seed) for seed in range(3)]
    other = write_run(tmp_path, "ppo-CartPole-v1-seed0-20250102-090000", learning_rate=1e-3)
    return seeds + [other]


def test_seeds_of_one_config_form_one_group(runs):
    groups = group_runs(runs)
    assert [group.label for group in groups] == ["ppo-CartPole-v1 (3 seeds)", "ppo-CartPole-v1-seed0-20250102-090000"]
    assert groups[0].run_dirs == runs[:3] and groups[1].run_dirs == runs[3:]


def test_without_configs_the_seed_token_in_the_name_groups_runs(tmp_path):
    runs = [write_run(tmp_path, name, config=False) for name in ("grpo_math_seed0", "grpo_math_seed1", "grpo_math")]
    assert [len(group.run_dirs) for group in group_runs(runs)] == [2, 1]


def test_a_seed_group_is_drawn_as_its_mean_with_a_min_max_band(runs):
    from matplotlib.figure import Figure

    axes = Figure().add_subplot()
    draw_metric(axes, group_runs(runs), "rollout/episode_return")
    assert len(axes.lines) == 2, "one line per experiment, not per run"
    assert len(axes.collections) == 1, "only the seed group gets a band"
    mean = axes.lines[0].get_ydata()
    np.testing.assert_allclose(mean, 20.0 + 5 * np.arange(30) + 1.0)  # seeds 0, 1, 2 shift the curve by 0..2
    band = axes.collections[0].get_paths()[0].vertices[:, 1]
    assert band.min() == pytest.approx(20.0) and band.max() == pytest.approx(20.0 + 5 * 29 + 2)


def test_plot_runs_writes_one_valid_png_per_present_group(runs, tmp_path):
    paths = plot_runs(runs, tmp_path / "plots")
    assert sorted(path.name for path in paths) == sorted(
        ["reward.png", "eval.png", "kl.png", "clip_fraction.png", "entropy.png", "grad_norm.png", "learning_rate.png"]
    )
    for path in paths:
        data = path.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000, path


def test_missing_matplotlib_names_the_extra(runs, tmp_path, monkeypatch):
    for module in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ValueError, match=r"pip install 'unipg\[plot\]'"):
        plot_runs(runs, tmp_path / "plots")


def test_cli_plot_prints_the_written_paths_for_chosen_metrics(runs, tmp_path):
    out = tmp_path / "figures"
    result = runner.invoke(
        app, ["plot", *map(str, runs), "--out", str(out), "--metric", "reward", "--metric", "train/grad_norm"]
    )
    assert result.exit_code == 0, result.output
    assert result.output.split() == [str(out / "reward.png"), str(out / "train_grad_norm.png")]
    assert all((out / name).read_bytes()[:8] == PNG_MAGIC for name in ("reward.png", "train_grad_norm.png"))


def test_cli_plot_errors_exit_2_with_a_message(runs, tmp_path):
    result = runner.invoke(app, ["plot", str(tmp_path / "nowhere"), "--out", str(tmp_path / "p")])
    assert result.exit_code == 2 and "holds no metrics.jsonl" in result.output
    result = runner.invoke(app, ["plot", str(runs[0]), "--out", str(tmp_path / "p"), "--metric", "rewrd"])
    assert result.exit_code == 2 and "no run logged 'rewrd'" in result.output and "reward" in result.output
