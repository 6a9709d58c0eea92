"""The built-in checks of the run doctor, one per row of the troubleshooting table, with their thresholds: here
those of what the policy learns (reward, KL, gradients, entropy and diversity, clipping, rewards that never
apply); those of time and memory are in ``unipg.observe.resource_checks``.

Each takes the run's ``History`` and returns ``Finding``s; the thresholds say why they sit where they do. The
numeric helpers they share (fitted rise, swings, levels, spikes) are in ``unipg.observe.trends``, and the reward
window the reward checks read (its scale and the task's best reward) in ``unipg.observe.reward_window``; the rule
that tells a converging policy from a collapsing one, which the collapse checks apply, in
``unipg.observe.convergence``.
"""

from __future__ import annotations

import math
import statistics

from unipg.observe.convergence import FLAT_RISE_FRACTION, progress
from unipg.observe.findings import CHECKS, Finding, History
from unipg.observe.reward_window import RewardWindow, reward_window
from unipg.observe.trends import (
    LEVEL_POINTS,
    differences,
    fmt,
    mean_swing,
    sign_alternation,
    span,
    spikes,
    start_and_latest,
)

# Reward oscillating: the mean step-to-step swing exceeds 15% of the reward scale. Batch-mean rewards of 64
# binary samples swing by ~7%, so 15% is more than sampling noise ...
OSCILLATION_SWING_FRACTION = 0.15
# ... the typical swing (std of differences) is 3x larger than the progress across the whole window ...
OSCILLATION_SWING_TO_RISE = 3.0
# ... and consecutive differences change sign at least 60% of the time (a single jump is not an oscillation).
OSCILLATION_ALTERNATION = 0.6
# KL spike: a value 10x the median of the preceding window. Healthy PPO on CartPole has single updates
# at ~6x the running median, so 10x is a jump no ordinary update makes.
KL_SPIKE_MEDIAN_MULTIPLE = 10.0
# With estimator.target_kl set, a KL 3x the target is beyond what the adaptive controller can steer back.
KL_SPIKE_TARGET_MULTIPLE = 3.0
# A KL below this moves the policy too little to matter, however large its ratio to the median.
KL_NOISE_FLOOR = 5e-3
# Gradient norm exploding: a value 20x the median of the preceding window. Healthy PPO on CartPole jumps to
# ~8x when the critic meets a new return scale; exploding gradients grow by orders of magnitude. (Clipping
# hides an explosion from the update, not from this metric: it is the norm before clipping.)
GRAD_SPIKE_MEDIAN_MULTIPLE = 20.0
# Entropy collapse: the latest entropy is below 10% of where the run started (and the policy is not converging).
ENTROPY_COLLAPSE_FRACTION = 0.1
# Diversity: distinct-2 fell below half its starting value ...
DISTINCT_DROP_FRACTION = 0.5
# ... or more than half of the samples are duplicates, up by at least 0.25 from the start.
DUPLICATE_FRACTION_MAX = 0.5
DUPLICATE_RISE_MIN = 0.25
# Clip fraction: PPO usually clips 5-20% of tokens; beyond 30% most updates are cut off by the clip.
CLIP_FRACTION_MAX = 0.3

KL_METRICS = ("train/kl", "train/approx_kl", "train/kl_to_reference")


# ---- reward: flat and oscillating ------------------------------------------------------------------------------


def still_rising(view: RewardWindow) -> bool:
    """The reward's trend across the window rises by at least the flat threshold."""
    return view.rise >= FLAT_RISE_FRACTION * view.scale


@CHECKS.register("reward_flat")
def reward_flat(history: History) -> list[Finding]:
    """Reward shows no upward trend over the window while below its ceiling (and is not oscillating)."""
    view = reward_window(history)
    if (
        view is None
        or view.saturated
        or still_rising(view)
        or mean_swing(view.values) > OSCILLATION_SWING_FRACTION * view.scale
    ):
        return []
    a, b = span(view.steps)
    ceiling = f", ceiling {fmt(view.ceiling)}" if view.ceiling is not None else ""
    evidence = (
        f"{view.name} trend moved {view.rise:+.4g} over steps {a}-{b} ({len(view.values)} points, mean "
        f"{fmt(statistics.fmean(view.values))}{ceiling}); under {FLAT_RISE_FRACTION:.0%} of the reward scale"
    )
    uniform = history.finite("rollout/uniform_group_fraction")[1][-history.window :]
    if uniform:
        evidence += (
            f"; {statistics.fmean(uniform):.0%} of prompt groups scored all samples alike "
            "(no learning signal from them)"
        )
    filtered = history.finite("async/filtered")[1][-history.window :]
    if filtered and statistics.fmean(filtered) > 0:  # measured after dynamic sampling replaced the alike groups
        evidence += (
            f", after dynamic sampling dropped {statistics.fmean(filtered):.3g} trajectories of alike groups "
            "per update (async/filtered)"
        )
    alike = "if most groups score alike, the reward gives no signal - make it denser or the task easier."
    if history.setting("estimator.kl_coef") == 0 and history.setting("estimator.target_kl") is None:
        remedy = (
            "The policy is hardly changing and no KL term holds it back: raise train.learning_rate, or average "
            "more samples per step (a larger train.batch_size) when a larger step only adds noise; " + alike
        )
    else:
        remedy = (
            "The policy is hardly changing: raise train.learning_rate or relax the KL constraint (smaller "
            "estimator.kl_coef, larger target_kl). train/grad_norm and the KL show which of the two holds it "
            "back; " + alike
        )
    return [Finding("reward_flat", "warning", evidence, remedy, view.name, (a, b))]


@CHECKS.register("reward_oscillating")
def reward_oscillating(history: History) -> list[Finding]:
    """Reward swings up and down by a large fraction of its scale, with little net progress."""
    view = reward_window(history)
    if view is None:
        return []
    diffs = differences(view.values)
    swing, rise, alternation = mean_swing(view.values), view.rise, sign_alternation(diffs)
    if (
        swing <= OSCILLATION_SWING_FRACTION * view.scale
        or statistics.pstdev(diffs) <= OSCILLATION_SWING_TO_RISE * abs(rise)
        or alternation < OSCILLATION_ALTERNATION
    ):
        return []
    a, b = span(view.steps)
    evidence = (
        f"{view.name} swings by {fmt(swing)} per step on average over steps {a}-{b} "
        f"({swing / view.scale:.0%} of the reward scale {fmt(view.scale)}), direction flips "
        f"{alternation:.0%} of the time, net trend {rise:+.4g}"
    )
    remedy = (
        "Updates overshoot: lower train.learning_rate and collect more samples per update (larger batch) "
        "so the gradient estimate is less noisy; train/grad_norm shows how much it varies."
    )
    return [Finding("reward_oscillating", "warning", evidence, remedy, view.name, (a, b))]


# ---- KL and gradient spikes ------------------------------------------------------------------------------------


@CHECKS.register("kl_spike")
def kl_spike(history: History) -> list[Finding]:
    """KL jumps beyond a multiple of its running median, or of ``estimator.target_kl`` when set."""
    target = history.setting("estimator.target_kl", history.setting("target_kl"))
    absolute = KL_SPIKE_TARGET_MULTIPLE * float(target) if isinstance(target, (int, float)) else None
    findings = []
    for name in KL_METRICS:
        steps, values = history.finite(name)
        found = spikes(
            steps,
            values,
            multiple=KL_SPIKE_MEDIAN_MULTIPLE,
            window=history.window,
            floor=KL_NOISE_FLOOR,
            absolute=absolute,
        )
        if not found:
            continue
        step, peak, reference = max(found, key=lambda spike: spike[1])
        against = "no history yet" if math.isnan(reference) else f"running median {fmt(reference)}"
        target_text = f", target_kl {fmt(target)}" if absolute is not None else ""
        evidence = (
            f"{name} spiked at {len(found)} step(s) between {found[0][0]} and {found[-1][0]}; peak "
            f"{fmt(peak)} at step {step} ({against}{target_text})"
        )
        remedy = (
            "The policy jumped away from where it was: raise estimator.kl_coef (or lower target_kl) and "
            "lower train.learning_rate; read recent samples too - a sudden KL jump is often the policy "
            "exploiting a flaw in the reward."
        )
        findings.append(Finding("kl_spike", "warning", evidence, remedy, name, (found[0][0], found[-1][0])))
    return findings


@CHECKS.register("grad_norm_exploding")
def grad_norm_exploding(history: History) -> list[Finding]:
    """The gradient norm jumps beyond a multiple of its running median."""
    steps, values = history.finite("train/grad_norm")
    found = spikes(steps, values, multiple=GRAD_SPIKE_MEDIAN_MULTIPLE, window=history.window)
    if not found:
        return []
    step, peak, reference = max(found, key=lambda spike: spike[1])
    evidence = (
        f"train/grad_norm exceeded {GRAD_SPIKE_MEDIAN_MULTIPLE:g}x its running median at {len(found)} "
        f"step(s) between {found[0][0]} and {found[-1][0]}; peak {fmt(peak)} at step {step} "
        f"(median {fmt(reference)})"
    )
    remedy = (
        "Lower train.learning_rate, keep train.max_grad_norm set so clipping bounds each step, and "
        "normalise advantages (estimator.normalize_advantages) and rewards so their scale stays bounded."
    )
    return [Finding("grad_norm_exploding", "error", evidence, remedy, "train/grad_norm", (found[0][0], found[-1][0]))]


@CHECKS.register("non_finite_values")
def non_finite_values(history: History) -> list[Finding]:
    """Any metric logged as null (NaN or infinite)."""
    bad = []
    for name in history.metric_names():
        steps, values = history.series(name)
        bad_steps = [step for step, value in zip(steps, values) if value is None]
        if bad_steps:
            bad.append((bad_steps[0], name, bad_steps))
    if not bad:
        return []
    bad.sort()
    parts = [f"{name} at {len(found)} record(s), steps {found[0]}-{found[-1]}" for _, name, found in bad[:5]]
    more = f" and {len(bad) - 5} more metric(s)" if len(bad) > 5 else ""
    evidence = "non-finite (NaN/inf) values: " + "; ".join(parts) + more
    remedy = (
        "Every update after the first NaN/inf is suspect: restart from a checkpoint before it with a lower "
        "train.learning_rate and gradient clipping (train.max_grad_norm), and check that the reward "
        "function never returns NaN or inf."
    )
    first = min(found[0] for _, _, found in bad)
    last = max(found[-1] for _, _, found in bad)
    skipped_steps, skipped = history.finite("train/skipped_steps")
    handled = {step for step, count in zip(skipped_steps, skipped) if count > 0}
    if all(name.startswith("train/") and set(found) <= handled for _, name, found in bad):
        remedy = (
            "Rollback skipped those optimizer steps, so nothing non-finite reached the weights; if it keeps "
            "happening, lower train.learning_rate or train.max_grad_norm and check the rewards."
        )
        return [
            Finding(
                "non_finite_values",
                "warning",
                evidence + " (optimizer steps skipped)",
                remedy,
                bad[0][1],
                (first, last),
            )
        ]
    return [Finding("non_finite_values", "error", evidence, remedy, bad[0][1], (first, last))]


# ---- entropy and diversity: collapse, or convergence -----------------------------------------------------------

COLLAPSE_REMEDY = (
    "The policy is turning deterministic and will repeat itself (mode collapse): raise "
    "estimator.kl_coef to keep it near the reference model, add an entropy bonus "
    "(estimator.entropy_coef > 0), and read samples for repetition."
)


@CHECKS.register("entropy_collapse")
def entropy_collapse(history: History) -> list[Finding]:
    """Policy entropy fell to a small fraction of its starting value, and the policy is not converging
    (``progress``, over the same steps): a policy that settles on what pays while its reward rises (an agent's
    call template is nearly deterministic) or sits at the task's best is learning, not collapsing."""
    # A continuous (Gaussian) policy's differential entropy can be negative and has no floor at 0.
    change = start_and_latest(history, "train/entropy")
    if change is None or change.lowest < 0 or change.latest >= ENTROPY_COLLAPSE_FRACTION * change.start:
        return []
    run = progress(history, change.steps)
    if run.converging:
        return []
    evidence = (
        f"{change.describe('fell')} ({change.latest / change.start:.0%} of its start; collapse below "
        f"{ENTROPY_COLLAPSE_FRACTION:.0%})"
    )
    return [Finding("entropy_collapse", "warning", run.qualify(evidence), COLLAPSE_REMEDY, change.name, change.steps)]


@CHECKS.register("low_diversity")
def low_diversity(history: History) -> list[Finding]:
    """Samples become repetitive (distinct-2 halves, or duplicates take over the batch) and the policy is not
    converging (``progress``): over the steps the diversity fell, the reward was flat or falling, or the groups
    stopped succeeding. Repetition while the reward rises and the groups succeed is the policy agreeing on the
    right answer (an agent's task with one right call per prompt), not mode collapse."""
    distinct = start_and_latest(history, "rollout/distinct_2")
    duplicates = start_and_latest(history, "rollout/duplicate_fraction")
    narrowed = []
    if distinct is not None and distinct.latest < DISTINCT_DROP_FRACTION * distinct.start:
        narrowed.append((distinct, "fell"))
    if (
        duplicates is not None
        and duplicates.latest > DUPLICATE_FRACTION_MAX
        and duplicates.latest - duplicates.start >= DUPLICATE_RISE_MIN
    ):
        narrowed.append((duplicates, "rose"))
    findings = []
    for change, verb in narrowed:
        run = progress(history, change.steps)
        if not run.converging:
            findings.append(
                Finding(
                    "low_diversity",
                    "warning",
                    run.qualify(change.describe(verb)),
                    COLLAPSE_REMEDY,
                    change.name,
                    change.steps,
                )
            )
    return findings


@CHECKS.register("clip_fraction_high")
def clip_fraction_high(history: History) -> list[Finding]:
    """The recent mean clip fraction is above what a healthy PPO update clips."""
    steps, values = history.finite("train/clip_fraction")
    steps, values = steps[-history.window :], values[-history.window :]
    if len(values) < LEVEL_POINTS or statistics.fmean(values) <= CLIP_FRACTION_MAX:
        return []
    evidence = (
        f"train/clip_fraction averaged {statistics.fmean(values):.2f} over steps {steps[0]}-{steps[-1]} "
        f"(max {max(values):.2f}; healthy is under {CLIP_FRACTION_MAX:.2f})"
    )
    remedy = (
        "Most ratios hit the clip, so the policy that sampled the data and the one being updated are too far "
        "apart - too much happens between sampling and updating: fewer epochs or samples per update "
        "(train.num_epochs, train.batch_size), sample more often, or lower train.learning_rate."
    )
    stale_steps, staleness = history.finite("async/staleness_trajectory_mean")
    if staleness and statistics.fmean(staleness[-history.window :]) > 0:
        remedy += (
            f" The data is also {statistics.fmean(staleness[-history.window :]):.1f} versions old on average: "
            "lower runtime.max_staleness, or clip against the learner's own weights with "
            "estimator.policy_loss=decoupled_ppo."
        )
    return [Finding("clip_fraction_high", "warning", evidence, remedy, "train/clip_fraction", span(steps))]


# ---- rewards that never apply ----------------------------------------------------------------------------------

REWARD_NONE_PREFIX = "rollout/reward_none_fraction/"  # logged per reward function by the lm rollout


@CHECKS.register("reward_never_applies")
def reward_never_applies(history: History) -> list[Finding]:
    """A reward function returned None (not applicable) for every completion of a batch, so it added nothing."""
    findings = []
    for metric in (name for name in history.metric_names() if name.startswith(REWARD_NONE_PREFIX)):
        steps, fractions = history.finite(metric)
        unscored = [step for step, fraction in zip(steps, fractions) if fraction >= 1.0]
        if not unscored:
            continue
        function = metric.removeprefix(REWARD_NONE_PREFIX)
        always = len(unscored) == len(steps)
        evidence = (
            f"reward function '{function}' returned None for every completion in {len(unscored)} of "
            f"{len(steps)} logged step(s) (steps {unscored[0]}-{unscored[-1]})"
            + ("; it has never scored a completion, so the run trains without it" if always else "")
        )
        remedy = (
            f"Check what '{function}' reads: it returns None (not applicable) when the keyword argument it "
            "expects (a dataset column) is missing or its answer parser never matches the completions. Fix "
            "the function or its column name, or remove it from task.rewards."
        )
        findings.append(
            Finding(
                "reward_never_applies",
                "error" if always else "warning",
                evidence,
                remedy,
                metric,
                (unscored[0], unscored[-1]),
            )
        )
    return findings
