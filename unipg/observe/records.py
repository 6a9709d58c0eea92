"""Reading a run's ``metrics.jsonl``: one JSON object per line, ``null`` for a value that was not finite."""

from __future__ import annotations

import json
import math
from pathlib import Path


def finite_or_none(value) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of a run's metrics.jsonl, skipping a torn last line (a run killed mid-write)."""
    records = []
    for line in (Path(run_dir) / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
