"""The run doctor's checks of the machinery around learning: where a step's time goes and whether memory grows.

Like ``unipg.observe.checks`` (the checks of what the policy learns), each takes the run's ``History`` and
returns ``Finding``s, and the thresholds say why they sit where they do.
"""

from __future__ import annotations

import statistics
from collections import Counter

from unipg.observe.findings import CHECKS, Finding, History
from unipg.observe.trends import LEVEL_POINTS, MIN_TREND_POINTS, differences, fmt, span

# Slow training: collecting data (environment, generation, reward) takes over 80% of the step, so the
# learner sits idle most of the time ...
DATA_SHARE_MAX = 0.8
# ... or an asynchronous learner reports itself idle more than half of the time.
IDLE_FRACTION_MAX = 0.5
# Timed phases that produce data rather than learn from it.
DATA_PHASES = ("env", "generate", "rollout", "reward", "tool")
# Memory growth: after a warm-up (allocator caches fill in the first steps), memory rises at 80% of the
# logged steps and ends 25% above where it was.
MEMORY_WARMUP_FRACTION = 0.1
MEMORY_RISE_FRACTION = 0.8
MEMORY_GROWTH_MIN = 0.25
MEMORY_KEYWORDS = ("rss", "memory", "mem_mb", "allocated")


# ---- time per step ---------------------------------------------------------------------------------------------


def phase_seconds(record: dict) -> dict[str, float]:
    """Seconds per timed phase; rates, fractions, the whole step and evaluation are not phases of a step."""
    phases = {
        key.removeprefix("timing/"): float(value)
        for key, value in record.items()
        if key.startswith("timing/") and isinstance(value, (int, float))
    }
    return {
        phase: seconds
        for phase, seconds in phases.items()
        if phase not in ("step", "eval") and not phase.endswith(("_per_second", "_fraction"))
    }


SLOW_REMEDY = (
    "The learner waits for data: sample asynchronously (with an off-policy weight for the stale "
    "samples), run more environments or generation in parallel, and enlarge the replay buffer so a "
    "batch is always ready."
)


@CHECKS.register("slow_training")
def slow_training(history: History) -> list[Finding]:
    """Data collection dominates the step, or the learner reports itself idle."""
    findings = []
    timed = [(int(record.get("step", 0)), phase_seconds(record)) for record in history.records]
    timed = [(step, phases) for step, phases in timed if phases][-history.window :]
    totals: Counter[str] = sum((Counter(phases) for _, phases in timed), Counter())
    data = {phase: seconds for phase, seconds in totals.items() if phase in DATA_PHASES}
    if len(timed) >= LEVEL_POINTS and data and sum(data.values()) > DATA_SHARE_MAX * sum(totals.values()):
        slowest, total = max(data, key=data.get), sum(totals.values())
        evidence = (
            f"collecting data took {sum(data.values()) / total:.0%} of the timed step over steps "
            f"{timed[0][0]}-{timed[-1][0]}; timing/{slowest} alone {data[slowest] / total:.0%}"
        )
        findings.append(
            Finding("slow_training", "warning", evidence, SLOW_REMEDY, f"timing/{slowest}", (timed[0][0], timed[-1][0]))
        )
    steps, idle = history.finite("timing/learner_idle_fraction")
    steps, idle = steps[-history.window :], idle[-history.window :]
    if len(idle) >= LEVEL_POINTS and statistics.fmean(idle) > IDLE_FRACTION_MAX:
        evidence = (
            f"timing/learner_idle_fraction averaged {statistics.fmean(idle):.0%} over steps {steps[0]}-{steps[-1]}"
        )
        findings.append(
            Finding("slow_training", "warning", evidence, SLOW_REMEDY, "timing/learner_idle_fraction", span(steps))
        )
    return findings


# ---- memory ----------------------------------------------------------------------------------------------------


@CHECKS.register("memory_growth")
def memory_growth(history: History) -> list[Finding]:
    """A memory metric rises almost every step, well past its post-warm-up level."""
    findings = []
    for name in history.metric_names():
        if not any(keyword in name.lower() for keyword in MEMORY_KEYWORDS):
            continue
        steps, values = history.finite(name)
        skip = int(len(values) * MEMORY_WARMUP_FRACTION)
        steps, values = steps[skip:], values[skip:]
        if len(values) < MIN_TREND_POINTS or values[0] <= 0:
            continue
        rising = sum(diff > 0 for diff in differences(values)) / (len(values) - 1)
        growth = values[-1] / values[0] - 1
        if rising >= MEMORY_RISE_FRACTION and growth >= MEMORY_GROWTH_MIN:
            evidence = (
                f"{name} rose from {fmt(values[0])} to {fmt(values[-1])} ({growth:+.0%}) over steps "
                f"{steps[0]}-{steps[-1]}, up at {rising:.0%} of the logged steps"
            )
            remedy = (
                "Memory climbs steadily and will run out: look for something that accumulates (tensors kept "
                "with their graph, an unbounded buffer or history); to lower the peak, use a smaller batch or "
                "shorter sequences and reach the batch size by gradient accumulation."
            )
            findings.append(Finding("memory_growth", "warning", evidence, remedy, name, span(steps)))
    return findings
