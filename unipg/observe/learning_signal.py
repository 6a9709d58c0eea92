"""The doctor's check for a reward that cannot move because the groups carry no learning signal.

A group-relative estimator (GRPO, RLOO) scores each episode against the other episodes of its prompt, so a group
whose returns are all equal — every episode failed, or every one succeeded — gets zero advantage everywhere and
contributes no gradient. When nearly every group is like that the reward stays flat however long the run, and
the fix is on the data side, not in the learning rate. With process rewards (agent tasks) a group in which every
episode failed still differs by its calls, so it is not uniform, yet the task reward teaches nothing there either:
the check fires as well when nearly every group has no success at all. The lm runtime logs, every update, the fraction of such
groups (``rollout/uniform_group_fraction``) and of groups that all failed or all succeeded
(``rollout/unsolved_group_fraction``, ``rollout/solved_group_fraction``; ``unipg.runtime.backends.local_lm``).
"""

from __future__ import annotations

import statistics

from unipg.observe.findings import CHECKS, Finding, History
from unipg.observe.trends import span

# Zero-variance groups: at least 90% of groups scored alike, on average over the window. A learning GRPO run
# keeps at least a few mixed groups in every batch; at 90% a batch of 16 groups teaches from one or two.
UNIFORM_GROUP_FRACTION_MAX = 0.9
# Enough updates that one unlucky batch does not decide (a short run of 30 updates has them by update 3).
MIN_SIGNAL_POINTS = 3
# Group sizes suggested when a larger group would give most prompts a mixed outcome.
SUGGESTED_GROUP_SIZES = (4, 8, 16, 32, 64)
# A group size is suggested when it gives at least this share of groups a success and a failure.
MIXED_GROUP_TARGET = 0.5


def mixed_group_chance(success_rate: float, group_size: int) -> float:
    """Chance that a group of ``group_size`` independent episodes holds a success and a failure:
    1 − p^G − (1 − p)^G.

    >>> round(mixed_group_chance(0.05, 8), 3)
    0.337
    """
    return 1.0 - success_rate**group_size - (1.0 - success_rate) ** group_size


def window_mean(history: History, name: str) -> float | None:
    values = history.finite(name)[1][-history.window :]
    return statistics.fmean(values) if values else None


@CHECKS.register("zero_variance_groups")
def zero_variance_groups(history: History) -> list[Finding]:
    """Nearly every prompt group scored all its episodes alike, so group-relative advantages are all zero; or
    nearly every group had no success, so whatever differs within a group is process rewards, not the task."""
    steps, values = history.finite("rollout/uniform_group_fraction")
    steps, values = steps[-history.window :], values[-history.window :]
    if len(values) < MIN_SIGNAL_POINTS:
        return []
    uniform = statistics.fmean(values)
    unsolved = window_mean(history, "rollout/unsolved_group_fraction")
    solved = window_mean(history, "rollout/solved_group_fraction")
    first, last = span(steps)
    if uniform >= UNIFORM_GROUP_FRACTION_MAX:
        evidence = (
            f"rollout/uniform_group_fraction averaged {uniform:.0%} over steps {first}-{last}: nearly every "
            "group scored all its episodes alike, so their advantages are zero and they teach nothing"
        )
        if unsolved is not None and solved is not None:
            evidence += f" ({unsolved:.0%} of groups: every episode failed; {solved:.0%}: every episode succeeded)"
    elif unsolved is not None and unsolved >= UNIFORM_GROUP_FRACTION_MAX:
        evidence = (
            f"rollout/unsolved_group_fraction averaged {unsolved:.0%} over steps {first}-{last}: in nearly "
            "every group no episode completed the task, so what differs within a group is only process "
            f"rewards (rollout/uniform_group_fraction {uniform:.0%}); the task reward teaches nothing"
        )
    else:
        return []
    if solved is not None and solved > (unsolved or 0.0):
        remedy = (
            "The task is solved at this difficulty: nothing is left to learn from these prompts. Make it "
            "harder (task.options), or stop here."
        )
    else:
        remedy = all_fail_remedy(history)
    return [
        Finding("zero_variance_groups", "warning", evidence, remedy, "rollout/uniform_group_fraction", (first, last))
    ]


def all_fail_remedy(history: History) -> str:
    """What to change when almost no episode succeeds, with the run's current settings where known."""
    group = history.setting("sample.samples_per_prompt")
    temperature = history.setting("sample.temperature")
    success = window_mean(history, "rollout/completion_rate")
    bigger = ""
    if isinstance(group, int) and success is not None and 0.0 < success < 1.0:
        fits = [
            size
            for size in SUGGESTED_GROUP_SIZES
            if size > group and mixed_group_chance(success, size) >= MIXED_GROUP_TARGET
        ]
        if fits:
            bigger = (
                f"; at the current success rate ({success:.1%}) a group of {fits[0]} has a success and a "
                f"failure {mixed_group_chance(success, fits[0]):.0%} of the time, against "
                f"{mixed_group_chance(success, group):.0%} now"
            )
    now = lambda value: f" (now {value})" if value is not None else ""  # noqa: E731
    return (
        "Successes are too rare for the group to see one. In order of cost: (1) a stronger warm start "
        "(more sft.steps or an sft.stages curriculum; `unipg eval --run RUN --show 4` shows what the policy "
        "does, e.g. whether it calls the tool and copies the arguments); (2) a larger group, "
        f"sample.samples_per_prompt{now(group)}{bigger}; (3) a higher sample.temperature{now(temperature)} "
        "for more varied attempts; (4) denser rewards: process rewards for a valid call and a successful tool "
        "result (agent.process_weight) or partial credit in task.rewards; (5) an easier curriculum "
        "(task.options, e.g. fewer digits), raised as the policy improves. Where a few groups are mixed, "
        "sample.dynamic_sampling=true trains on those and samples other prompts in place of the rest."
    )
