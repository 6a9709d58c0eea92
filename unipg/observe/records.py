"""Reading a run's ``metrics.jsonl``: one JSON object per line, ``null`` for a value that was not finite.

A damaged file (edited by hand, written by another tool) never stops a reader: a torn last line (a run killed
mid-write) is dropped, a line that is not a JSON object with a whole-number ``step`` is skipped, and a value that is not a number or ``null`` is left
out of its record; ``MetricsFile`` counts both, so the doctor and the plots can say what they ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path


def finite_or_none(value) -> float | None:
    try:
        value = float(value)
    except OverflowError:  # an integer too large for a float
        return None
    return value if math.isfinite(value) else None


@dataclass
class MetricsFile:
    """The readable records of a metrics.jsonl and what was ignored in it."""

    records: list[dict] = field(default_factory=list)
    """``{"step": int, "<metric>": float or None, ...}``, in file order."""
    skipped_lines: int = 0
    """non-blank lines that were not a JSON object with a whole-number ``step``."""
    ignored_values: int = 0
    """values in kept records that were not a number or null (strings, booleans, arrays, objects)."""

    def damage(self, path: Path) -> str | None:
        """One sentence on what was ignored in ``path``, or None when nothing was."""
        if not self.skipped_lines and not self.ignored_values:
            return None
        parts = [
            f"{count} {what}"
            for count, what in (
                (self.skipped_lines, "malformed line(s) skipped"),
                (self.ignored_values, "non-numeric value(s) ignored"),
            )
            if count
        ]
        return f"'{path}': {' and '.join(parts)} (a line must be a JSON object with a whole-number \"step\")"


def load_metrics(run_dir: Path) -> MetricsFile:
    """The records of a run's metrics.jsonl, with damaged lines skipped and non-numeric values left out."""
    text = (Path(run_dir) / "metrics.jsonl").read_text(encoding="utf-8", errors="replace")
    loaded = MetricsFile()
    lines = text.split("\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record = _parse_line(line)
        if record is None:
            torn = number == len(lines)  # the last line of a file that does not end in a newline: mid-write
            loaded.skipped_lines += not torn
            continue
        clean = {"step": record.pop("step")}
        for key, value in record.items():
            if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
                clean[key] = None if value is None else finite_or_none(value)
            else:
                loaded.ignored_values += 1
        loaded.records.append(clean)
    return loaded


def read_metrics(run_dir: Path) -> list[dict]:
    """The readable records of a run's metrics.jsonl (see ``load_metrics``)."""
    return load_metrics(run_dir).records


def _parse_line(line: str) -> dict | None:
    """The line as a dict with an int ``step``, or None when it is not one (torn, not JSON, not an object)."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # bad JSON, an integer past the conversion limit, deep nesting
        return None
    if not isinstance(record, dict):
        return None
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step) or step != int(step):
        return None
    record["step"] = int(step)
    return record
