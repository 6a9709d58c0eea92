"""Learning curves of one or more runs: one PNG per metric group, x = step, one curve per experiment.

Runs that differ only in their seed are drawn as one curve, the mean over seeds with a min-max band, since one
seed alone cannot tell a better method from a lucky one (seed 000, section 5.4). Two runs are seeds of one
experiment when both have a ``config.yaml`` equal apart from ``seed`` and the ``log`` section, or, without
configs, when their folder names are equal once the ``seed<N>`` token and the launch timestamp are removed.

matplotlib is an optional dependency (``pip install 'unipg[plot]'``); figures are drawn with the Agg canvas
directly, so plotting never changes the pyplot backend of the calling program.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from unipg.observe.records import load_metrics

# Metric groups, one PNG each; a pattern ending in "*" matches every metric with that prefix.
METRIC_GROUPS: dict[str, tuple[str, ...]] = {
    "reward": ("rollout/episode_return", "rollout/reward_mean"),
    "eval": ("eval/return_mean", "eval/pass@*"),
    "kl": ("train/kl", "train/approx_kl", "train/kl_to_reference"),
    "clip_fraction": ("train/clip_fraction",),
    "entropy": ("train/entropy",),
    "diversity": ("rollout/distinct_2", "rollout/duplicate_fraction"),
    "grad_norm": ("train/grad_norm",),
    "staleness": ("async/staleness*",),
    "learning_rate": ("train/learning_rate",),
}
SEED_TOKEN = re.compile(r"[-_.]?seed[-_]?\d+", re.IGNORECASE)
TIMESTAMP_SUFFIX = re.compile(r"-\d{8}-\d{6}(?:-\d+)?$")  # run_dir_for's "-YYYYmmdd-HHMMSS[-n]"
# Config sections that do not change what is trained, only where and how it is logged.
NON_EXPERIMENT_KEYS = ("seed", "log")


@dataclass
class RunGroup:
    """Runs of one experiment (several seeds, or a single run)."""

    label: str
    """legend entry: the run's folder name, or the shared name and the number of seeds."""
    run_dirs: list[Path]
    records: list[list[dict]]
    """metrics.jsonl records of each run, in the order of ``run_dirs``."""
    damage: list[str]
    """what was ignored in damaged metrics.jsonl files (see ``MetricsFile.damage``)."""


def plot_runs(run_dirs: list[Path], out_dir: Path, *, metrics: list[str] | None = None) -> list[Path]:
    """Write one PNG per metric group present (or per name in ``metrics``) into ``out_dir``; return the paths.

    ``metrics`` entries are group names (``reward``, ``kl``, ... see ``METRIC_GROUPS``) or exact metric names.
    """
    figure_class, canvas_class = load_matplotlib()
    groups = group_runs([Path(run_dir) for run_dir in run_dirs])
    for note in (note for group in groups for note in group.damage):
        print(f"warning: {note}", file=sys.stderr)
    plan = plot_plan(groups, metrics)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, names in plan.items():
        figure = figure_class(figsize=(8, 2.8 * len(names) + 0.6), layout="constrained")
        canvas_class(figure)
        for index, name in enumerate(names):
            axes = figure.add_subplot(len(names), 1, index + 1)
            draw_metric(axes, groups, name)
            if index == 0:
                axes.legend(fontsize="small")
        axes.set_xlabel("step")
        path = out_dir / f"{stem}.png"
        figure.savefig(path, dpi=100)
        written.append(path)
    return written


def load_matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError("plotting needs matplotlib, which is not installed: pip install 'unipg[plot]'") from None
    return Figure, FigureCanvasAgg


def group_runs(run_dirs: list[Path]) -> list[RunGroup]:
    """Runs grouped by experiment, in the order each experiment first appears."""
    if not run_dirs:
        raise ValueError("no run folders given; pass one or more folders that hold a metrics.jsonl")
    grouped: dict[tuple[str, str], list[Path]] = {}
    for run_dir in run_dirs:
        if not (run_dir / "metrics.jsonl").is_file():
            raise ValueError(
                f"'{run_dir}' holds no metrics.jsonl; pass the folder of a training run "
                "(e.g. runs/ppo-CartPole-v1-seed0-...)"
            )
        grouped.setdefault(experiment_key(run_dir), []).append(run_dir)
    groups = []
    for members in grouped.values():
        loaded = [load_metrics(run_dir) for run_dir in members]
        damage = [
            note for run_dir, metrics in zip(members, loaded) if (note := metrics.damage(run_dir / "metrics.jsonl"))
        ]
        groups.append(RunGroup(group_label(members), members, [metrics.records for metrics in loaded], damage))
    return groups


def experiment_key(run_dir: Path) -> tuple[str, str]:
    config = read_config(run_dir)
    if config is not None:
        kept = {key: value for key, value in config.items() if key not in NON_EXPERIMENT_KEYS}
        return "config", json.dumps(kept, sort_keys=True, default=str)
    base = base_name(run_dir.name)
    # A name without a seed token names one run; its full path keeps it apart from same-named runs elsewhere.
    return ("name", base) if base != run_dir.name else ("path", str(run_dir.resolve()))


def read_config(run_dir: Path) -> dict | None:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError:
        return None  # an unreadable config only means grouping falls back to the folder name
    return config if isinstance(config, dict) else None


def base_name(name: str) -> str:
    """The folder name without its seed token and launch timestamp (unchanged when it has no seed token)."""
    if not SEED_TOKEN.search(name):
        return name
    return TIMESTAMP_SUFFIX.sub("", SEED_TOKEN.sub("", name)) or name


def group_label(members: list[Path]) -> str:
    if len(members) == 1:
        return members[0].name
    return f"{base_name(members[0].name)} ({len(members)} seeds)"


def plot_plan(groups: list[RunGroup], requested: list[str] | None) -> dict[str, list[str]]:
    """File stem → metric names drawn in it (one subplot each)."""
    available = list(
        dict.fromkeys(
            key
            for group in groups
            for records in group.records
            for record in records
            for key, value in record.items()
            if key not in ("step", "time") and value is not None
        )
    )
    if requested is None:
        plan = {group: matching(available, patterns) for group, patterns in METRIC_GROUPS.items()}
        plan = {group: names for group, names in plan.items() if names}
        if not plan:
            raise ValueError(f"none of the runs logged a plotted metric; they logged: {', '.join(available)}")
        return plan
    plan = {}
    for name in requested:
        names = (
            matching(available, METRIC_GROUPS[name]) if name in METRIC_GROUPS else [name] if name in available else []
        )
        if not names:
            raise ValueError(
                f"no run logged '{name}'; metric groups: {', '.join(METRIC_GROUPS)}; metrics: {', '.join(available)}"
            )
        plan[name if name in METRIC_GROUPS else re.sub(r"[^A-Za-z0-9_.-]+", "_", name)] = names
    return plan


def matching(available: list[str], patterns: tuple[str, ...]) -> list[str]:
    names = []
    for pattern in patterns:
        if pattern.endswith("*"):
            names += sorted(name for name in available if name.startswith(pattern[:-1]))
        elif pattern in available:
            names.append(pattern)
    return names


def metric_series(records: list[dict], metric: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps and finite values of ``metric`` (null, i.e. non-finite, points are left out)."""
    pairs = [(record["step"], record[metric]) for record in records if record.get(metric) is not None]
    return np.array([step for step, _ in pairs], dtype=float), np.array([value for _, value in pairs], dtype=float)


def seed_curve(series: list[tuple[np.ndarray, np.ndarray]]):
    """Mean, min and max over seeds on the steps any seed logged within the range all seeds cover."""
    series = [(steps, values) for steps, values in series if len(steps)]
    if len(series) == 1:
        steps, values = series[0]
        return steps, values, None, None
    start, end = max(steps[0] for steps, _ in series), min(steps[-1] for steps, _ in series)
    grid = np.unique(np.concatenate([steps for steps, _ in series]))
    inside = grid[(grid >= start) & (grid <= end)]
    grid = inside if len(inside) else grid  # seeds that never overlap are still compared, held at their ends
    stacked = np.stack([np.interp(grid, steps, values) for steps, values in series])
    return grid, stacked.mean(axis=0), stacked.min(axis=0), stacked.max(axis=0)


def draw_metric(axes, groups: list[RunGroup], metric: str) -> None:
    """One line per group on ``axes``; a group of several seeds also gets its min-max band."""
    for color_index, group in enumerate(groups):
        series = [metric_series(records, metric) for records in group.records]
        if not any(len(steps) for steps, _ in series):
            continue
        steps, mean, low, high = seed_curve(series)
        color = f"C{color_index % 10}"
        axes.plot(steps, mean, color=color, label=group.label, marker="." if len(steps) < 30 else None)
        if low is not None:
            axes.fill_between(steps, low, high, color=color, alpha=0.2, linewidth=0)
    axes.set_title(metric, fontsize="medium")
    axes.grid(alpha=0.3)
