"""Run diagnosis: the troubleshooting table of seed 000 (sections 5.1 and 5.3) as checks over a metrics stream.

Each check (the built-in ones are in ``unipg.observe.checks`` and ``unipg.observe.resource_checks``) is a small
pure function of a run's ``History`` that returns ``Finding``s: which condition was seen, the evidence (metric,
steps, numbers) and what to try. Checks live in the ``CHECKS`` registry, so a project adds
its own with ``@CHECKS.register("my_check")``. ``diagnose`` runs them over a run's ``metrics.jsonl`` records;
``Monitor`` runs them over a sliding window during training and reports each condition once, when it starts.

A ``null`` in ``metrics.jsonl`` is a value that was NaN or infinite when it was logged.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Iterable

import yaml

from unipg.observe import checks as _checks  # noqa: F401  (registers the checks of what the policy learns)
from unipg.observe import learning_signal as _learning_signal  # noqa: F401  (registers zero_variance_groups)
from unipg.observe import resource_checks as _resource_checks  # noqa: F401  (registers the time and memory checks)
from unipg.observe.findings import CHECKS, DEFAULT_WINDOW, Finding, History
from unipg.observe.records import finite_or_none, load_metrics

# Monitor: how many records it keeps, and how many clean observations re-arm a condition that fired.
MONITOR_WINDOW = 50
REARM_AFTER = 5


def diagnose(
    records: Iterable[dict],
    *,
    config: dict | None = None,
    window: int = DEFAULT_WINDOW,
    checks: list[str] | None = None,
) -> list[Finding]:
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
        raise ValueError(
            f"'{run_dir}' {where}; pass the folder of a training run (e.g. runs/ppo-CartPole-v1-seed0-...)"
        )
    try:
        loaded = load_metrics(run_dir)
        config_path = run_dir / "config.yaml"
        config = yaml.safe_load(config_path.read_text(encoding="utf-8")) if config_path.is_file() else None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise ValueError(f"cannot read the run in '{run_dir}': {error}") from None
    damage = loaded.damage(metrics_path)
    if not loaded.records:
        if damage:
            raise ValueError(f"{damage}; no readable record is left to diagnose")
        raise ValueError(f"'{metrics_path}' has no records yet; run the doctor once training has logged a step")
    findings = diagnose(loaded.records, config=config if isinstance(config, dict) else None, window=window)
    if damage:
        findings.insert(
            0,
            Finding(
                "metrics_file",
                "warning",
                damage,
                "the findings use only the readable records; "
                "metrics.jsonl is written by training, so check what else wrote to it",
                "metrics.jsonl",
            ),
        )
    return findings


def format_report(findings: list[Finding]) -> str:
    """Plain text, one block per finding; "no problems found" for a healthy run."""
    if not findings:
        return "no problems found"
    errors = sum(finding.severity == "error" for finding in findings)
    lines = [f"{len(findings)} finding(s): {errors} error(s), {len(findings) - errors} warning(s)"]
    for finding in findings:
        lines += [
            "",
            f"[{finding.severity}] {finding.check}",
            f"  evidence: {finding.evidence}",
            f"  remedy:   {finding.remedy}",
        ]
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

    def __init__(
        self,
        window: int = MONITOR_WINDOW,
        *,
        config: dict | None = None,
        rearm_after: int = REARM_AFTER,
        checks: list[str] | None = None,
        min_records: int = DEFAULT_WINDOW,
    ):
        self.window, self.config, self.rearm_after, self.checks = window, config or {}, rearm_after, checks
        self.min_records, self.observed = min_records, 0
        self.records: deque[dict] = deque(maxlen=window)
        self._clear_for: dict[tuple[str, str], int] = {}  # active condition → observations it has been clear

    def observe(self, step: int, metrics: dict[str, float | None]) -> list[Finding]:
        self.records.append(
            {
                "step": int(step),
                **{key: None if value is None else finite_or_none(value) for key, value in metrics.items()},
            }
        )
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
