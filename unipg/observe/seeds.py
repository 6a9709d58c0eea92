"""Several seeds of one configuration: the final value of every metric, aggregated as mean ± std.

``unipg train --seeds 0,1,2`` runs the seeds one after another and then writes
``<output_dir>/<algorithm>-<task or env>-seeds-<seeds>-<time>.json`` (every metric's per-seed final values, mean
and population standard deviation) and a Markdown table beside it with the same numbers.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from unipg.observe.metrics import read_metrics


def final_metrics(run_dir: Path) -> dict[str, float]:
    """Each metric's last finite value in the run's metrics.jsonl (``step`` and ``time`` left out)."""
    final: dict[str, float] = {}
    for record in read_metrics(run_dir):
        final.update(
            {
                key: value
                for key, value in record.items()
                if key not in ("step", "time") and isinstance(value, (int, float))
            }
        )
    return final


def aggregate(run_dirs: list[Path]) -> dict[str, dict]:
    """{metric: {"mean", "std", "values"}} over the runs, for the metrics every run logged."""
    finals = [final_metrics(run_dir) for run_dir in run_dirs]
    shared = sorted(set.intersection(*(set(final) for final in finals))) if finals else []
    return {
        key: {"mean": statistics.fmean(values), "std": statistics.pstdev(values), "values": values}
        for key in shared
        for values in [[final[key] for final in finals]]
    }


def write_seed_summary(output_dir: Path, name: str, seeds: list[int], run_dirs: list[Path]) -> Path:
    """Write the JSON and Markdown aggregate of a multi-seed run; returns the JSON path."""
    summary = aggregate(run_dirs)
    stem = f"{name}-seeds-{'-'.join(map(str, seeds))}-{time.strftime('%Y%m%d-%H%M%S')}"
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / f"{stem}.json"
    path.write_text(
        json.dumps({"seeds": seeds, "runs": [str(run_dir) for run_dir in run_dirs], "final": summary}, indent=2),
        encoding="utf-8",
    )
    rows = [
        f"| {key} | {entry['mean']:.4g} ± {entry['std']:.2g} | "
        f"{', '.join(f'{value:.4g}' for value in entry['values'])} |"
        for key, entry in summary.items()
        if not key.startswith("timing/")
    ]
    seed_list = ", ".join(map(str, seeds))
    table = [
        f"# {name}: final metrics over seeds {seed_list}",
        "",
        "| metric | mean ± std | per seed |",
        "|---|---:|---|",
        *rows,
    ]
    path.with_suffix(".md").write_text("\n".join(table) + "\n", encoding="utf-8")
    return path


def write_results_summary(results) -> Path:
    """``write_seed_summary`` of the ``(config, result)`` pairs of one configuration's seeds, in the first
    config's ``log.output_dir`` and named ``<algorithm>-<task or env>``; returns the JSON path."""
    first = results[0][0]
    name = f"{first.algorithm}-{first.task.name if first.is_lm else first.env.id}"
    return write_seed_summary(
        Path(first.log.output_dir),
        name,
        [config.seed for config, _ in results],
        [result.run_dir for _, result in results],
    )
