"""What happened in a run: the metrics stream and progress display (``metrics``, ``records``), plots, multi-seed
summaries, result tables (``report``), and the doctor with its findings, checks and trend helpers."""

from unipg.observe import checks as _checks  # noqa: F401  (registers the doctor's checks)
from unipg.observe import resource_checks as _resource_checks  # noqa: F401  (registers its time and memory checks)
from unipg.observe.findings import CHECKS, Check, Finding

__all__ = ["CHECKS", "Check", "Finding"]
