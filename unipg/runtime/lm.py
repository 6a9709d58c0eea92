"""Training of language-model policies on text tasks, synchronous or with bounded staleness.

One learner update reads top to bottom: take the groups of ``batch_size / samples_per_prompt`` prompts from
the runtime (each group ``samples_per_prompt`` episodes of one prompt, with their behaviour log-probs and the
weights version of every turn; ``unipg.runtime.backends.local_lm``), compute reference log-probs and values, estimate
advantages, take ``num_epochs`` passes of mini-batch steps, publish the new weights. Greedy pass@1 and sampled
pass@k on the test split (``eval/…``) are measured before training, every ``eval.every_updates`` updates and at
the end, to report; at the same updates after the first, greedy pass@1 on the validation split (``val/…``) is what
decisions read: ``checkpoint.best_metric`` ranks the checkpoints by it. No decision reads the test split.

With ``runtime.max_staleness`` = 0 (the default) every sample's behaviour policy μ is the policy the update
starts from, so ρ = 1 at the first mini-batch step: synchronous training. With η > 0 samples may be up to η
versions old and the configured objective corrects for it (``unipg.runtime.driver``, docs/runtime.md).

Checkpoints (``run/checkpoints/step-<update>``) are saved every ``checkpoint.every_updates`` updates, at the
end, and when Ctrl-C or SIGTERM stops the run after its current update (or, when that update's rollout or evaluation
has not ended ``STOP_GRACE_SECONDS`` after the signal, with the last finished update; ``unipg.runtime.stopping``).
``train_lm(config, resume=RUN_DIR)`` continues from the newest one exactly as the uninterrupted run would have:
weights, optimizer, KL coefficient, learning-rate fraction, the prompt order and every random generator are restored
(``unipg.checkpoint.lm``).

With ``rollback.enabled``, an update that trips (an optimizer step skipped for a non-finite loss or gradient, or
the whole update reverted for a KL spike, see ``unipg.learn.lm``) is logged as a ``skipped_update``
event in ``run/events.jsonl`` with a warning on standard error. After ``rollback.max_trips`` tripped updates in
a row the run goes back to its newest checkpoint (a fresh run saves one of update 0 for this, deleted when it
saves the next), multiplies the learning rate by ``rollback.lr_factor``, logs a ``rollback`` event and trains on
from there; the checkpoint's prompt order and random generators come back with it. metrics.jsonl keeps the
records of the updates given up, so its steps repeat after a rollback.

Stopping on a signal, rolling back and ending after a rollout failure live in ``unipg.runtime.stopping``; a run's
parts (``LMRun``) are built by ``open_run`` (``unipg.runtime.lm_run``); here ``train_updates`` is the loop of updates.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

from unipg.checkpoint.lm import latest_checkpoint
from unipg.config import Config
from unipg.config.timeouts import WaitTimeout
from unipg.estimate import needs_greedy_baseline
from unipg.learn.lm import LMBatch, LMLearner
from unipg.observe.episodes import EpisodeLog
from unipg.observe.metrics import Timer, process_metrics, release_free_memory
from unipg.observe.rollout_metrics import rollout_metrics
from unipg.runtime.driver import EpisodeAccount, Runtime, StepReport
from unipg.runtime.evaluation import evaluate_episodes, evaluate_lm  # noqa: F401  (evaluate_lm: re-exported)
from unipg.runtime.greedy_baseline import greedy_baseline
from unipg.runtime.lm_run import LMRun, LMTrainResult, finished_run, open_run
from unipg.runtime.offline import OfflineData, offline_metrics
from unipg.runtime.replay import Group, ProducerFailed
from unipg.runtime.stopping import (  # TrainingStopped: where callers catch it
    RolloutPosition,
    StopRequest,
    TrainingStopped,
    UpdateAbandoned,
    roll_back,
    rollout_failed,
    update_abandoned,
    waited_too_long,
)
from unipg.sample.episodes import EpisodeRunner, PromptEncoder, held_out  # noqa: F401  (PromptEncoder: re-exported)
from unipg.sample.transcripts import transcript
from unipg.tasks.base import Task


def group_index(groups: list[Group]) -> list[int]:
    """The group of each episode of ``groups`` (all their items, in order) for the group estimators: the
    episodes of one ``Group`` that play one role (all of them, in a one-role task)."""
    numbers: dict[tuple, int] = {}
    return [numbers.setdefault((number, t.role), len(numbers)) for number, g in enumerate(groups) for t in g.items]


def rollout_batch(groups: list[Group], version: int, *, pad_id: int, offline: list[Group] = ()) -> LMBatch:
    """The learner's batch of the step that starts from ``version``: the episodes of ``groups`` (group after group),
    then those of the ``offline`` groups, padded with ``pad_id``, each with its group (``group_index``)."""
    everything = [*groups, *offline]
    return LMBatch.from_trajectories(
        [t for g in everything for t in g.items], pad_id, version=version, groups=group_index(everything)
    )


def row_roles(config, groups: list[Group]) -> dict[str, list[str]]:
    """With an adapter or a model per role (``agent.role_policy: adapters`` or ``separate``), the learner's ``roles``
    argument: the role of each row of the batch of ``groups`` (laid out as ``rollout_batch`` does); else nothing."""
    if config.agent.role_policy == "shared":
        return {}
    return {"roles": [t.role for g in groups for t in g.items for _ in t.rows]}


def train_step(
    runtime: Runtime,
    learner: LMLearner,
    timer: Timer,
    update: int,
    *,
    group_size: int,
    tools: bool,
    offline: OfflineData | None = None,
    episodes: EpisodeLog | None = None,
    stop: StopRequest | None = None,
    greedy: EpisodeRunner | None = None,
) -> tuple[dict[str, float], int, StepReport]:
    """Update ``update``: the next groups (``group_size`` episodes each, with tool calls if ``tools``) from the runtime
    and their share from ``offline``, their reference log-probs and values, the estimator's epochs of mini-batch steps,
    the new weights published; fresh episodes go to ``episodes``. With ``greedy``, first one greedy episode per prompt
    on that runner, whose returns the estimator reads (``unipg.runtime.greedy_baseline``). Its metrics record, samples
    and the runtime's report. ``ProducerFailed`` (rollout cannot go on) or ``UpdateAbandoned`` (``stop`` gave up the
    rollout or the greedy episodes) come before any learning."""
    start = time.time()
    recorded = offline.count(update) if offline is not None else 0
    abandonable = stop.abandonable if stop is not None else contextlib.nullcontext
    with abandonable():
        groups, step = runtime.next_groups(update - 1, runtime.groups_per_step - recorded)
    extra = offline.take(recorded, update - 1) if recorded else []
    batch = rollout_batch(groups, update - 1, pad_id=learner.policy.pad_id, offline=extra)
    roles = row_roles(learner.config, [*groups, *extra])
    fresh = [t for g in groups for t in g.items]
    record = step_record(step, fresh, batch, group_size=group_size, tools=tools)
    if greedy is not None:
        with abandonable(), timer("greedy_baseline"):
            batch.greedy_scores, baseline_metrics = greedy_baseline(greedy, groups, update - 1)
        record.update(baseline_metrics)
    if episodes is not None:
        episodes.write(fresh, update=update)
    with timer("logprob"):
        # keys with a namespace of their own (mismatch/...) are logged as they are
        record.update({k if "/" in k else f"train/{k}": v for k, v in learner.prepare(batch, **roles).items()})
        if offline is not None:
            record.update(
                offline_metrics(batch, sum(len(t.rows) for g in extra for t in g.items), learner.policy, learner.config)
            )
    with timer("update"):
        # each role's adapter's metrics (agent.role_policy: adapters) are role/<role>/...
        record.update(
            {k if k.startswith("role/") else f"train/{k}": v for k, v in learner.update(batch, **roles).items()}
        )
    runtime.publish(update)
    seconds = time.time() - start
    record.update(timer.pop())
    release_free_memory()  # freed heap pages go back to the system, so system/rss_mb follows what is in use
    record.update(process_metrics())
    record.update(
        {
            "timing/step": seconds,
            "timing/samples_per_second": len(batch.scores) / seconds,
            "timing/tokens_per_second": record["rollout/generated_tokens"] / seconds,
        }
    )
    return record, len(batch.scores), step


def step_record(step: StepReport, fresh: list, batch: LMBatch, *, group_size: int, tools: bool) -> dict[str, float]:
    """The metrics of a step's rollout: the runtime's (``step``), those of its ``fresh`` episodes and ``batch``, and
    the rollout's report."""
    report = step.rollout
    return {
        **step.metrics(),
        **rollout_metrics(
            fresh,
            batch,
            group_size=group_size,
            tools=tools,
            wait_seconds=step.learner_wait,
            batch_sizes=report.batch_sizes,
            generate_seconds=report.generate_seconds,
        ),
        **report.metrics(),
    }


def log_update(run: LMRun, update: int, record: dict[str, float], stop: StopRequest | None = None) -> dict[str, float]:
    """Evaluate after ``update`` if it is due (every ``eval.every_updates`` and the last), log ``record`` if due,
    advance the progress bar; the evaluation (empty if none). An evaluation that ``stop`` gives up (``UpdateAbandoned``)
    leaves ``record`` logged without it."""
    config, updates = run.config, run.config.train.updates
    evaluation = {}
    if update % config.eval.every_updates == 0 or update == updates:
        with run.timer("eval"):
            try:
                with stop.abandonable() if stop is not None else contextlib.nullcontext():
                    evaluation = run_evaluation(run, update)
            except UpdateAbandoned:
                run.logger.log(update, record)
                raise
        run.history.append((update, evaluation))
        record.update(evaluation)
    if update % config.log.log_every_updates == 0 or update == updates or "eval/pass@1" in record:
        run.logger.log(update, record)
    run.progress.update(
        update, f"reward {record['rollout/reward_mean']:.3f} pass@1 {run.history[-1][1]['eval/pass@1']:.3f}"
    )
    return evaluation


def run_evaluation(run: LMRun, update: int) -> dict[str, float]:
    """The evaluation after ``update`` (0: before training): ``report_evaluation`` on the test split, and after an
    update ``validation_evaluation``, whose ``val/…`` metrics rank the checkpoint saved with it. Before training no
    decision needs the validation split."""
    evaluation = report_evaluation(run, update)
    if update > 0 and run.validation:
        evaluation.update(validation_evaluation(run))
    return evaluation


def report_evaluation(run: LMRun, update: int) -> dict[str, float]:
    """The test split's metrics after ``update`` (``eval/…``: greedy pass@1 and sampled pass@k), which report and
    decide nothing; the transcripts of its first ``eval.transcripts`` greedy episodes go to the run folder
    (``transcripts/eval_<update>.jsonl``). The only reader of the test split during a run."""
    config = run.config
    evaluation, greedy = evaluate_episodes(
        run.runner, run.test, pass_k=config.eval.pass_k, seed=config.seed + 10_000 + update
    )
    if config.eval.transcripts:
        run.logger.transcripts(update, [transcript(trajectory) for trajectory in greedy[: config.eval.transcripts]])
    return evaluation


def validation_evaluation(run: LMRun) -> dict[str, float]:
    """The validation split's greedy metrics (``val/pass@1``, turns, tool use, lengths), which decisions read
    (``checkpoint.best_metric``). Greedy only, on a split kept small (``eval.validation_examples``), so that it costs
    little beside the test split's sampled episodes."""
    return evaluate_episodes(run.runner, run.validation, pass_k=0, seed=0, prefix="val")[0]


def train_updates(run: LMRun, stop: StopRequest) -> None:
    """Updates ``run.first`` … ``train.updates``, each evaluated and logged when due, rolled back after too many
    trips, checkpointed every ``checkpoint.every_updates``, at the end and when ``stop`` was asked for."""
    config, updates, every = run.config, run.config.train.updates, run.config.checkpoint.every_updates
    update = run.first
    while update <= updates:
        fraction = 1.0 - (update - 1) / updates if config.train.lr_schedule == "linear" else 1.0
        lr = run.learner.set_lr_fraction(fraction)
        position = RolloutPosition.of(run.checkpointer)  # saved instead, if this update is given up
        try:
            record, size, step = train_step(
                run.runtime,
                run.learner,
                run.timer,
                update,
                group_size=config.sample.samples_per_prompt,
                tools=run.runner.service is not None,
                offline=run.offline,
                episodes=run.episodes,
                stop=stop,
                greedy=run.runner if needs_greedy_baseline(config.estimator.advantage) else None,
            )
        except UpdateAbandoned:  # a stop was asked for and rollout did not end within its grace
            raise update_abandoned(run, update - 1, stop.signal_number, position=position) from None
        except ProducerFailed as failure:  # rollout cannot go on: keep what is trained, say how to go on
            timed_out = isinstance(failure.__cause__, WaitTimeout)
            raise (WaitTimeout if timed_out else ValueError)(rollout_failed(failure, run, update - 1)) from failure
        run.episode_counts = step.rollout.episodes.state() if step.rollout.episodes is not None else None
        run.train_seconds += record["timing/step"]
        run.samples += size
        record.update({"train/learning_rate": lr, "train/samples": run.samples})
        try:
            evaluation = log_update(run, update, record, stop)
        except UpdateAbandoned:  # the update is trained; its evaluation was given up
            raise update_abandoned(run, update, stop.signal_number, position=None) from None
        if run.trips.observe(update, record):
            good, run.samples, run.history = roll_back(update, run.checkpointer, run.runtime, run.trips)
            update = good + 1
            continue
        stopping = stop.signal_number is not None and update < updates
        if stopping or update == updates or (every and update % every == 0):
            run.checkpointer.save(
                update,
                samples=run.samples,
                train_seconds=run.train_seconds,
                history=run.history,
                metrics=evaluation,
                episodes=run.episode_counts,
            )
            run.saved = update
        if stopping:
            raise TrainingStopped(run.run_dir, update, stop.signal_number)
        update += 1


def train_lm(
    config: Config, *, task: Task | None = None, resume: str | Path | None = None, log: Callable[[str], None] = print
) -> LMTrainResult:
    """Train ``config.model.name`` on ``config.task.name`` with the configured estimator.

    With ``resume`` (the folder of an earlier run), continue that run from its newest checkpoint, appending to
    its metrics.jsonl; a run whose checkpoint is already at ``train.updates`` is reported and not trained.
    """
    updates = config.train.updates
    checkpoint = latest_checkpoint(Path(resume)) if resume is not None else None
    if checkpoint is not None and checkpoint.step >= updates:
        log(
            f"run {resume} already finished at update {checkpoint.step} of {updates}; raise train.updates "
            "to train further"
        )
        return finished_run(Path(resume), checkpoint)
    run = open_run(config, task, Path(resume) if resume is not None else None, checkpoint, log)
    config = run.config
    with StopRequest() as stop:
        try:
            if checkpoint is None:
                with stop.abandonable():  # given up, it stops the run with nothing to save (KeyboardInterrupt)
                    initial = run_evaluation(run, 0)
                run.history = [(0, initial)]
                run.logger.log(0, initial)
                if config.rollback.enabled:  # something to roll back to before the first periodic checkpoint
                    run.checkpointer.save(
                        0,
                        samples=0,
                        train_seconds=0.0,
                        history=run.history,
                        metrics={},
                        episodes=EpisodeAccount().state(),
                    )  # no episode has run yet
            run.runtime.reset(run.first - 1)  # rollout starts from the weights (and prompt order) training starts from
            run.saved = run.first - 1 if checkpoint is not None or config.rollback.enabled else None
            try:
                train_updates(run, stop)
            except WaitTimeout as timeout:  # the learner's ranks, or an evaluation's engine, did not answer
                raise waited_too_long(timeout, run) from timeout.__cause__
            run.policy.save(run.run_dir / "policy")
        finally:
            run.close()  # within the stop's bound: a run that hangs while closing still ends on a signal
    return LMTrainResult(
        run.run_dir,
        updates,
        run.samples,
        time.time() - run.started,
        run.history[0][1],
        run.history[-1][1],
        run.history,
        run.train_seconds,
        resumed_from=run.first - 1,
    )
