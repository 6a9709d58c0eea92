"""Trend helpers of the doctor's checks: a metric's fitted rise, its swings and sign flips, its level at the
start and now, and spikes against a running median. Pure functions of lists of floats (and a ``History``)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from unipg.observe.findings import History

# Fewer points than this cannot separate a trend from noise, so the trend checks stay silent.
MIN_TREND_POINTS = 10
# Points averaged for the "start" and "latest" level of a metric, so one noisy point decides nothing.
LEVEL_POINTS = 3
# A running median needs a few preceding points before a jump can be called a spike.
SPIKE_MIN_PRIOR_POINTS = 5


def fitted_rise(values: list[float]) -> float:
    """Least-squares slope against the point index, times the span: how far the trend line moves."""
    count = len(values)
    if count < 2:
        return 0.0
    mean_index, mean_value = (count - 1) / 2, statistics.fmean(values)
    covariance = sum((index - mean_index) * (value - mean_value) for index, value in enumerate(values))
    variance = sum((index - mean_index) ** 2 for index in range(count))
    return covariance / variance * (count - 1)


def fitted_rise_error(values: list[float]) -> float:
    """Standard error of ``fitted_rise``, from the scatter of the values about the trend line (ordinary least
    squares: s / √Σ(i − ī)², times the span); 0 for fewer than three points or values exactly on a line."""
    count = len(values)
    if count < 3:
        return 0.0
    rise, mean_index, mean_value = fitted_rise(values), (count - 1) / 2, statistics.fmean(values)
    slope = rise / (count - 1)
    residuals = [value - mean_value - slope * (index - mean_index) for index, value in enumerate(values)]
    variance = sum((index - mean_index) ** 2 for index in range(count))
    scatter = (sum(residual**2 for residual in residuals) / (count - 2)) ** 0.5
    return scatter / variance**0.5 * (count - 1)


def differences(values: list[float]) -> list[float]:
    return [after - before for before, after in zip(values, values[1:])]


def sign_alternation(diffs: list[float]) -> float:
    """Fraction of consecutive differences whose sign flips."""
    pairs = [(a, b) for a, b in zip(diffs, diffs[1:]) if a != 0 and b != 0]
    return sum((a > 0) != (b > 0) for a, b in pairs) / len(pairs) if pairs else 0.0


def level(values: list[float], *, start: bool) -> float:
    return statistics.fmean(values[:LEVEL_POINTS] if start else values[-LEVEL_POINTS:])


@dataclass(frozen=True)
class LevelChange:
    """Where a metric started and where it is now (each the mean of a few points)."""

    name: str
    start: float
    latest: float
    lowest: float
    steps: tuple[int, int]

    def describe(self, verb: str) -> str:
        first, last = self.steps
        return f"{self.name} {verb} from {fmt(self.start)} to {fmt(self.latest)} over steps {first}-{last}"


def start_and_latest(history: History, name: str) -> LevelChange | None:
    """None when the metric has too few points, or starts at zero or below (no fraction of it is meaningful)."""
    steps, values = history.finite(name)
    if len(values) < 2 * LEVEL_POINTS or level(values, start=True) <= 0:
        return None
    return LevelChange(name, level(values, start=True), level(values, start=False), min(values), span(steps))


def fmt(value: float) -> str:
    return f"{value:.4g}"


def span(steps: list[int]) -> tuple[int, int]:
    return steps[0], steps[-1]


def mean_swing(values: list[float]) -> float:
    return statistics.fmean(abs(diff) for diff in differences(values))


def spikes(
    steps: list[int],
    values: list[float],
    *,
    multiple: float,
    window: int,
    floor: float = 0.0,
    absolute: float | None = None,
) -> list[tuple[int, float, float]]:
    """(step, value, reference) where value > multiple × median of the preceding window, or > ``absolute``.

    A zero median (no gradient yet, e.g. every group scored alike) gives no scale, so nothing is a spike of it.
    """
    found = []
    for index, (step, value) in enumerate(zip(steps, values)):
        prior = values[max(0, index - window) : index]
        reference = statistics.median(prior) if len(prior) >= SPIKE_MIN_PRIOR_POINTS else None
        relative = bool(reference) and value > multiple * reference and value > floor
        if relative or (absolute is not None and value > absolute):
            found.append((step, value, reference if reference is not None else float("nan")))
    return found
