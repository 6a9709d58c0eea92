"""Run diagnosis: the troubleshooting table of seed 000 (sections 5.1 and 5.3) as checks over a metrics stream.

Each check (the built-in ones are in ``unipg.run.checks``) is a small pure function of a run's ``History`` that returns ``Finding``s: which condition was seen,
the evidence (metric, steps, numbers) and what to try. Checks live in the ``CHECKS`` registry, so a project adds
its own with ``@CHECKS.register("my_check")``. ``diagnose`` runs them over a run's ``metrics.jsonl`` records;
``Monitor`` runs them over a sliding window during training and reports each condition once, when it starts.

A ``null`` in ``metrics.jsonl`` is a value that was NaN or infinite when it was logged.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Literal

import yaml

from unipg.estimate.registry import Registry
from unipg.run.metrics import finite_or_none, read_metrics

# Points of a metric the trend checks (reward flat / oscillating) look back over.
DEFAULT_WINDOW = 20
# Monitor: how many records it keeps, and how many clean observations re-arm a condition that fired.
MONITOR_WINDOW = 50
REARM_AFTER = 5

@dataclass(frozen=True)
class Finding:
    """One diagnosed condition of a run."""

    check: str
    """name of the check in ``CHECKS`` that fired."""
    severity: Literal["warning", "error"]
    """error: the run's numbers are already corrupted; warning: training is likely wasting its time."""
    evidence: str
    """what was seen: metric, step range, values."""
    remedy: str
    """what to change, after seed 000's troubleshooting table."""
    metric: str = ""
    """the metric the evidence is about (with ``check``, identifies the condition for ``Monitor``)."""
    steps: tuple[int, int] | None = None
    """first and last step of the evidence."""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class History:
    """What a check sees: the records of a run, the trend window and the run's configuration."""

    records: list[dict]
    """metrics.jsonl records, ``{"step", "time", "<namespace>/<name>": value or None}``, oldest first."""
    window: int = DEFAULT_WINDOW
    """how many points of a metric the trend checks look back over."""
    config: dict = field(default_factory=dict)
    """the run's config.yaml as a dict (may be empty)."""

    def series(self, name: str) -> tuple[list[int], list[float | None]]:
        """Steps and values of the records that hold ``name``; None marks a non-finite value."""
        pairs = [(int(record.get("step", index)), record[name]) for index, record in enumerate(self.records)
                 if name in record]
        return [step for step, _ in pairs], [value for _, value in pairs]

    def finite(self, name: str) -> tuple[list[int], list[float]]:
        steps, values = self.series(name)
        kept = [(step, float(value)) for step, value in zip(steps, values) if isinstance(value, (int, float))]
        return [step for step, _ in kept], [value for _, value in kept]

    def metric_names(self) -> list[str]:
        seen = dict.fromkeys(key for record in self.records for key in record if key not in ("step", "time"))
        return list(seen)

    def setting(self, dotted: str, default=None):
        """A config value by dotted key (``estimator.target_kl``), or ``default`` when absent."""
        node = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node


Check = Callable[[History], list[Finding]]
CHECKS: Registry[Check] = Registry("check")


def diagnose(records: Iterable[dict], *, config: dict | None = None, window: int = DEFAULT_WINDOW,
             checks: list[str] | None = None) -> list[Finding]:
    """Run the named checks (all registered ones by default); errors first, then by check name."""
    history = History(list(records), window, config or {})
    findings = [finding for name in (checks or CHECKS.names()) for finding in CHECKS.get(name)(history)]
    return sorted(findings, key=lambda finding: (finding.severity != "error", finding.check, finding.metric))


def diagnose_run(run_dir: Path, *, window: int = DEFAULT_WINDOW) -> list[Finding]:
    """``diagnose`` a run folder: its metrics.jsonl, with config.yaml (for target_kl, env.id) when present."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        where = "does not exist" if not run_dir.exists() else "holds no metrics.jsonl"
        raise ValueError(f"'{run_dir}' {where}; pass the folder of a training run "
                         "(e.g. runs/ppo-CartPole-v1-seed0-...)")
    try:
        records = read_metrics(run_dir)
        config_path = run_dir / "config.yaml"
        config = yaml.safe_load(config_path.read_text(encoding="utf-8")) if config_path.is_file() else None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise ValueError(f"cannot read the run in '{run_dir}': {error}") from None
    if not records:
        raise ValueError(f"'{metrics_path}' has no records yet; run the doctor once training has logged a step")
    return diagnose(records, config=config if isinstance(config, dict) else None, window=window)


def format_report(findings: list[Finding]) -> str:
    """Plain text, one block per finding; "no problems found" for a healthy run."""
    if not findings:
        return "no problems found"
    errors = sum(finding.severity == "error" for finding in findings)
    lines = [f"{len(findings)} finding(s): {errors} error(s), {len(findings) - errors} warning(s)"]
    for finding in findings:
        lines += ["", f"[{finding.severity}] {finding.check}", f"  evidence: {finding.evidence}",
                  f"  remedy:   {finding.remedy}"]
    return "\n".join(lines)


def findings_json(findings: list[Finding]) -> str:
    return json.dumps([finding.to_dict() for finding in findings], indent=2)


class Monitor:
    """Live diagnosis: ``observe`` each logged record; it returns the findings whose condition just began.

    The checks see the last ``window`` records. A condition (check, metric) is reported when it first fires and
    again only after it has stayed clear for ``rearm_after`` observations, so a persistent problem warns once.
    Warnings wait for ``min_records`` records (early in a run a trend is mostly noise: a reward that takes ten
    updates to start rising is not flat); errors, such as a non-finite loss, are reported at once.
    """

    def __init__(self, window: int = MONITOR_WINDOW, *, config: dict | None = None,
                 rearm_after: int = REARM_AFTER, checks: list[str] | None = None, min_records: int = DEFAULT_WINDOW):
        self.window, self.config, self.rearm_after, self.checks = window, config or {}, rearm_after, checks
        self.min_records, self.observed = min_records, 0
        self.records: deque[dict] = deque(maxlen=window)
        self._clear_for: dict[tuple[str, str], int] = {}  # active condition → observations it has been clear

    def observe(self, step: int, metrics: dict[str, float | None]) -> list[Finding]:
        self.records.append({"step": int(step), **{key: None if value is None else finite_or_none(value)
                                                  for key, value in metrics.items()}})
        self.observed += 1
        current = diagnose(self.records, config=self.config, window=self.window, checks=self.checks)
        if self.observed < self.min_records:
            current = [finding for finding in current if finding.severity == "error"]
        new = [finding for finding in current if (finding.check, finding.metric) not in self._clear_for]
        fired = {(finding.check, finding.metric) for finding in current}
        for key in list(self._clear_for):
            self._clear_for[key] = 0 if key in fired else self._clear_for[key] + 1
            if self._clear_for[key] >= self.rearm_after:
                del self._clear_for[key]
        self._clear_for.update({key: 0 for key in fired})
        return new


from unipg.run import checks as _checks  # noqa: E402,F401  (registers the built-in checks)
