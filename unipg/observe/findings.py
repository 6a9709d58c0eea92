"""What the doctor's checks see and say: a run's ``History`` of metric records, the ``Finding``s a check
returns, and the ``CHECKS`` registry they are registered in."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Literal

from unipg.registry import Registry

# Points of a metric the trend checks (reward flat / oscillating) look back over.
DEFAULT_WINDOW = 20


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
        pairs = [
            (int(record.get("step", index)), record[name])
            for index, record in enumerate(self.records)
            if name in record
        ]
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
