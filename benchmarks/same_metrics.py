"""Do two runs write the same metrics? Compares every record of two runs' metrics.jsonl, wall-clock entries left
out, and prints one line per run pair: records, values compared, and the metrics that differ.

Used to check that a change of code layout changes no number: run the same configuration with the code before
(a worktree of the earlier commit, ``PYTHONPATH`` pointing at it) and after, then

    python benchmarks/same_metrics.py BEFORE_RUN_DIR AFTER_RUN_DIR [BEFORE_RUN_DIR AFTER_RUN_DIR ...]

Exit status 1 when any pair differs. ``--smoke`` trains a tiny CartPole PPO twice with the current code and
compares the two runs (the comparison itself, checked end to end).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

# seconds, throughput and machine load: they differ between any two runs of the same code
WALL_CLOCK_PREFIXES = ("time", "timing/", "system/", "perf/")
WALL_CLOCK_WORDS = ("seconds", "per_second", "_per_s", "tokens_per_s", "throughput", "elapsed")


def is_wall_clock(key: str) -> bool:
    return key.startswith(WALL_CLOCK_PREFIXES) or any(word in key for word in WALL_CLOCK_WORDS)


def read_records(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def same_value(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def compare(before: Path, after: Path) -> tuple[int, int, dict[str, int]]:
    """(records, values compared, {metric: records where it differs or is present in one run only})."""
    old, new = read_records(before), read_records(after)
    differ: dict[str, int] = {}
    if len(old) != len(new):
        differ["<record count>"] = abs(len(old) - len(new))
    compared = 0
    for a, b in zip(old, new):
        for key in sorted(set(a) | set(b)):
            if is_wall_clock(key):
                continue
            compared += 1
            if key not in a or key not in b or not same_value(a[key], b[key]):
                differ[key] = differ.get(key, 0) + 1
    return min(len(old), len(new)), compared, differ


def smoke_runs() -> list[str]:
    """Two tiny, identical CartPole PPO runs in a temporary folder: their run folders."""
    import tempfile

    import unipg

    root = Path(tempfile.mkdtemp(prefix="same-metrics-"))
    overrides = {"env__total_steps": 1024, "eval__every_steps": 512, "eval__episodes": 2, "log__output_dir": str(root)}
    return [
        str(unipg.train("configs/cartpole_ppo.yaml", log__run_name=name, **overrides).run_dir)
        for name in ("first", "second")
    ]


def main(argv: list[str]) -> int:
    if argv == ["--smoke"]:
        argv = smoke_runs()
    if len(argv) < 2 or len(argv) % 2:
        print("usage: python benchmarks/same_metrics.py BEFORE_RUN_DIR AFTER_RUN_DIR [...]", file=sys.stderr)
        return 2
    status = 0
    for before, after in zip(argv[::2], argv[1::2]):
        records, compared, differ = compare(Path(before), Path(after))
        verdict = "same" if not differ else "differ: " + ", ".join(f"{key} ({n})" for key, n in sorted(differ.items()))
        print(f"{before} vs {after}: {records} records, {compared} values compared, {verdict}")
        status |= bool(differ)
    return status


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
