"""Convergence or collapse: the rule the collapse checks (``entropy_collapse``, ``low_diversity`` in
``unipg.observe.checks``) apply before they speak, and the flat-reward threshold it shares with ``reward_flat``."""

from __future__ import annotations

from dataclasses import dataclass

from unipg.observe.findings import History
from unipg.observe.reward_window import reward_window
from unipg.observe.trends import MIN_TREND_POINTS, fitted_rise, fitted_rise_error

# Reward flat: the least-squares rise across the window is below 3% of the reward scale. A healthy run with
# per-step noise of a few percent still rises by several times this over 20 points.
FLAT_RISE_FRACTION = 0.03
# Converging, not collapsing (``progress``), judged over the steps the policy narrowed: the reward's least-squares
# rise over them clears the flat threshold and twice its standard error (the scatter of the rewards about their
# trend line), so noise on a flat reward passes for progress about one time in thirty; the 3% rise alone would,
# over 20 updates at the ~6% per-update noise of the mean of 64 binary rewards, about one time in four.
RISE_STANDARD_ERRORS = 2.0
# ... and the share of prompt groups with at least one success does not fall by 0.2 or more across them. A batch
# of 16 groups measures that share to within ±0.125 (binomial, at worst p = 0.5) and its trend line over 20
# updates to about ±0.09 (±0.08 over the main job's 30), so a fall of 0.2 is beyond noise.
SUCCESS_FALL = 0.2


@dataclass(frozen=True)
class Progress:
    """What the reward and the prompt groups' successes did over the steps a policy narrowed (falling entropy,
    repeated completions), which tells one that converges on what pays from one that collapses."""

    converging: bool
    """the reward rose or ends at the task's best, and the groups kept succeeding."""
    evidence: str
    """when not converging, why: a clause the collapse checks append to their evidence ("" without a reward)."""

    def qualify(self, evidence: str) -> str:
        return f"{evidence}, {self.evidence}" if self.evidence else evidence


def within(history: History, name: str, steps: tuple[int, int]) -> list[float]:
    """The finite values of ``name`` logged from step ``steps[0]`` to ``steps[1]``."""
    return [value for step, value in zip(*history.finite(name)) if steps[0] <= step <= steps[1]]


def success_share(history: History, steps: tuple[int, int]) -> tuple[str, list[float]] | None:
    """The share of prompt groups with at least one success at each update of ``steps`` (1 −
    ``rollout/unsolved_group_fraction``), or the episodes' ``rollout/completion_rate`` where groups are not
    logged; with the metric it comes from. None when neither is logged."""
    if values := within(history, "rollout/unsolved_group_fraction", steps):
        return "rollout/unsolved_group_fraction", [1.0 - value for value in values]
    if values := within(history, "rollout/completion_rate", steps):
        return "rollout/completion_rate", values
    return None


def progress(history: History, steps: tuple[int, int]) -> Progress:
    """Convergence or collapse over ``steps``, the steps a collapse check saw the policy narrow: the one rule of
    ``entropy_collapse`` and ``low_diversity``.

    A policy converging on the right answer narrows as surely as a collapsing one: an agent's task with one right
    call per prompt ends with every sample of a group alike. What differs is what it earns over the same steps: a
    converging policy's reward rises (its least-squares trend by more than the flat threshold and twice its
    standard error) or ends at the task's best, and its groups keep succeeding (the trend of the share of groups
    with a success does not fall by ``SUCCESS_FALL``). A collapsing one narrows while the reward is flat or
    falling, or while its groups stop succeeding (a reward that rises on a format or process term while the task
    is solved less often). A reward that rose and then stalls below the task's best is ``reward_flat``'s to report.
    """
    view = reward_window(history)  # its metric, scale and whether the run ends at the task's best
    if view is None:
        return Progress(False, "")  # nothing shows the policy converging
    first, last = steps
    rewards = within(history, view.name, steps)
    rise, rise_error = fitted_rise(rewards), fitted_rise_error(rewards)
    if not view.saturated and (rise < FLAT_RISE_FRACTION * view.scale or rise < RISE_STANDARD_ERRORS * rise_error):
        return Progress(
            False,
            f"while {view.name} did not rise (trend {rise:+.3g} ± {rise_error:.2g} over steps {first}-{last}, "
            f"{len(rewards)} points)",
        )
    success = success_share(history, steps)
    if success is not None and len(success[1]) >= MIN_TREND_POINTS:
        name, shares = success
        if (change := fitted_rise(shares)) <= -SUCCESS_FALL:
            what = "the share of prompt groups with a success" if name.endswith("group_fraction") else name
            return Progress(
                False,
                f"while {what} fell (trend {change:+.3g} over steps {first}-{last}, from {name}) though {view.name} "
                "rose",
            )
    return Progress(True, "")
