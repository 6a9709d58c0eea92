"""Training of language-model policies on text tasks, synchronous or with bounded staleness.

One learner update reads top to bottom: take the groups of ``batch_size / samples_per_prompt`` prompts from
the runtime (each group ``samples_per_prompt`` episodes of one prompt, with their behaviour log-probs and the
weights version of every turn; ``unipg.runtime.backends.local_lm``), compute reference log-probs and values, estimate
advantages, take ``num_epochs`` passes of mini-batch steps, publish the new weights. Held-out greedy pass@1
and sampled pass@k are measured before training, every ``eval.every_updates`` updates and at the end.

With ``runtime.max_staleness`` = 0 (the default) every sample's behaviour policy μ is the policy the update
starts from, so ρ = 1 at the first mini-batch step: synchronous training. With η > 0 samples may be up to η
versions old and the configured objective corrects for it (``unipg.runtime.driver``, docs/runtime.md).

Checkpoints (``run/checkpoints/step-<update>``) are saved every ``checkpoint.every_updates`` updates, at the
end, and when Ctrl-C or SIGTERM stops the run after its current update. ``train_lm(config, resume=RUN_DIR)``
continues from the newest one exactly as the uninterrupted run would have: weights, optimizer, KL coefficient,
learning-rate fraction, the prompt order and every random generator are restored (``unipg.checkpoint.lm``).

With ``rollback.enabled``, an update that trips (an optimizer step skipped for a non-finite loss or gradient, or
the whole update reverted for a KL spike, see ``unipg.learn.lm``) is logged as a ``skipped_update``
event in ``run/events.jsonl`` with a warning on standard error. After ``rollback.max_trips`` tripped updates in
a row the run goes back to its newest checkpoint (a fresh run saves one of update 0 for this, deleted when it
saves the next), multiplies the learning rate by ``rollback.lr_factor``, logs a ``rollback`` event and trains on
from there; the checkpoint's prompt order and random generators come back with it. metrics.jsonl keeps the
records of the updates given up, so its steps repeat after a rollback.

Stopping on a signal, rolling back and ending after a rollout failure live in ``unipg.runtime.stopping``; here
``open_run`` builds a run's parts (``LMRun``) and ``train_updates`` is the loop of updates.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import torch

from unipg.checkpoint.lm import LMCheckpointer, drop_metrics_after, latest_checkpoint
from unipg.checkpoint.store import Checkpoint
from unipg.config import Config
from unipg.learn.lm import LMBatch, LMLearner
from unipg.observe.episodes import EpisodeLog
from unipg.observe.metrics import MetricsLogger, Progress, Timer, process_metrics, release_free_memory
from unipg.observe.rollout_metrics import rollout_metrics, uniform_groups
from unipg.policy.lm import LMPolicy
from unipg.policy.loading import policy_from_config
from unipg.runtime.backends import BACKEND_INPUTS, BACKENDS, make_learner
from unipg.runtime.driver import EpisodeAccount, Runtime, StepReport, resolve_schedule
from unipg.runtime.evaluation import evaluate_episodes, evaluate_lm  # noqa: F401  (evaluate_lm: re-exported)
from unipg.runtime.offline import OfflineData, load_offline, offline_metrics
from unipg.runtime.prompts import PromptSampler
from unipg.runtime.replay import Group, ProducerFailed
from unipg.runtime.setup import check_ray_address, lock_run_dir, run_dir_for, seed_everything, set_threads
from unipg.runtime.stopping import (  # TrainingStopped: where callers catch it
    StopRequest,
    TrainingStopped,
    TripCounter,
    roll_back,
    rollout_failed,
)
from unipg.sample.episodes import EpisodeRunner, PromptEncoder, held_out  # noqa: F401  (PromptEncoder: re-exported)
from unipg.sample.transcripts import transcript
from unipg.tasks.base import Example, Task, make_task
from unipg.tasks.rewards.rules import build_rewards, reward_defaults


@dataclass
class LMTrainResult:
    """What a finished lm run reports."""

    run_dir: Path
    updates: int
    samples: int
    wall_seconds: float
    initial_eval: dict[str, float]
    final_eval: dict[str, float]
    eval_history: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    train_seconds: float = 0.0  # wall time of the updates alone, evaluation excluded
    resumed_from: int = 0  # the update of the checkpoint the run continued from (0: a fresh run)

    @property
    def samples_per_second(self) -> float:
        return self.samples / max(self.train_seconds, 1e-9)


def build_runtime(
    config: Config,
    runner: EpisodeRunner,
    sampler: PromptSampler,
    generator: torch.Generator,
    task: Task,
    reward_fn,
    log: Callable[[str], None] = print,
) -> Runtime:
    """The runtime of an lm run: sequential on the learner's own weights, or concurrent on a synced copy
    with its own episode runner (tools and environment service included); with ``backend: ray``, on rollout
    workers and environment actors of a Ray cluster (``unipg.runtime.backends.ray_lm``)."""
    settings = config.runtime
    schedule = resolve_schedule(settings.schedule, settings.max_staleness, config.deterministic)
    handed = (runner, sampler, generator, config, task, reward_fn, schedule, log)  # in BACKEND_INPUTS' order
    rollout = BACKENDS.call(config.backend, dict(zip(BACKEND_INPUTS, handed, strict=True)))
    try:
        return Runtime(
            rollout,
            groups_per_step=config.prompts_per_step,
            group_size=config.sample.samples_per_prompt,
            max_staleness=settings.max_staleness,
            capacity=config.sample.replay_buffer_size,
            schedule=schedule,
            sampling=settings.sampling,
            eviction=settings.eviction,
            freshness_decay=settings.freshness_decay,
            seed=config.seed,
            on_settled=sampler.settle,
            keep=mixed_returns if config.sample.dynamic_sampling else None,
            filter_budget=math.ceil(config.sample.dynamic_sampling_budget * config.prompts_per_step),
        )
    except ValueError:
        rollout.close()
        raise


def mixed_returns(group: Group) -> bool:
    """Whether the returns of ``group``'s episodes of some role differ (``uniform_groups``), so that a group-relative
    advantage is not zero for all of them: the test of dynamic sampling (``sample.dynamic_sampling``)."""
    return not all(uniform_groups([t.reward for t in group.items], group.size))


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


def finished_run(run_dir: Path, checkpoint: Checkpoint) -> LMTrainResult:
    """The result of a run whose newest ``checkpoint`` is already at ``train.updates``: nothing more is trained."""
    history = [(at, evaluation) for at, evaluation in checkpoint.state["eval_history"]]
    return LMTrainResult(
        run_dir,
        checkpoint.step,
        checkpoint.state["samples"],
        0.0,
        history[0][1],
        history[-1][1],
        history,
        checkpoint.state["train_seconds"],
        resumed_from=checkpoint.step,
    )


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
) -> tuple[dict[str, float], int, StepReport]:
    """Update ``update``: the next groups (of ``group_size`` episodes, with tool calls if ``tools``) from the
    runtime, and from ``offline`` its share of them, their reference log-probs and values, the estimator's epochs
    of mini-batch steps, the new weights published; the fresh episodes are written to ``episodes``. Its record
    (rollout, train, timing and system metrics), its number of samples and the runtime's report of its rollout;
    ``ProducerFailed`` when rollout cannot go on (from ``next_groups``, before anything of the update is done)."""
    start = time.time()
    recorded = offline.count(update) if offline is not None else 0
    groups, step = runtime.next_groups(update - 1, runtime.groups_per_step - recorded)
    extra = offline.take(recorded, update - 1) if recorded else []
    batch = rollout_batch(groups, update - 1, pad_id=learner.policy.pad_id, offline=extra)
    fresh, report = [t for g in groups for t in g.items], step.rollout
    record = {
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
    if episodes is not None:
        episodes.write(fresh, update=update)
    with timer("logprob"):
        # keys with a namespace of their own (mismatch/...) are logged as they are
        record.update({k if "/" in k else f"train/{k}": v for k, v in learner.prepare(batch).items()})
        if offline is not None:
            record.update(
                offline_metrics(batch, sum(len(t.rows) for g in extra for t in g.items), learner.policy, learner.config)
            )
    with timer("update"):
        record.update({f"train/{k}": v for k, v in learner.update(batch).items()})
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


@dataclass
class LMRun:
    """The parts of an lm run as ``train_lm`` builds them (``open_run``), and its running totals."""

    config: Config  # warm start resolved
    run_dir: Path
    policy: LMPolicy
    runner: EpisodeRunner  # the learner's; evaluation runs on it, and sequential rollout too
    test: list[Example]  # the held-out examples of evaluation
    learner: LMLearner
    checkpointer: LMCheckpointer
    logger: MetricsLogger
    progress: Progress
    trips: TripCounter
    runtime: Runtime | None = None
    timer: Timer = field(default_factory=Timer)
    started: float = field(default_factory=time.time)
    first: int = 1  # the first update to train (after the checkpoint resumed from)
    samples: int = 0
    train_seconds: float = 0.0
    history: list[tuple[int, dict[str, float]]] = field(default_factory=list)  # (update, evaluation)
    saved: int | None = None  # the update of the newest checkpoint this run can roll back or resume to
    lock: IO[str] | None = None  # the run folder's lock (``lock_run_dir``), released by ``close``
    offline: OfflineData | None = None  # ``data.offline``'s episodes, mixed into every batch
    episodes: EpisodeLog | None = None  # where ``log.episodes`` writes the trained episodes
    episode_counts: dict[str, int] | None = None  # the rollout's episode counts at the last update (checkpointed)

    def close(self) -> None:
        """Stop rollout, then close what the run opened (the rollout's own runner and actors first)."""
        if self.runtime is not None:
            self.runtime.close()
            self.runtime.rollout.close()
        self.runner.close()
        self.learner.close()
        self.progress.close()
        self.logger.close()
        if self.episodes is not None:
            self.episodes.close()
        if self.lock is not None:
            self.lock.close()


def open_run(
    config: Config, task: Task | None, run_dir: Path | None, checkpoint: Checkpoint | None, log: Callable[[str], None]
) -> LMRun:
    """Seed, build the policy, learner, checkpointer and logger of a run, continue ``checkpoint`` if given
    (``run_dir`` is then the run's folder), and start its runtime (``build_runtime``)."""
    from unipg.learn.warm_start import resolve_warm_start

    if config.backend == "ray":
        check_ray_address(config.ray.address)  # Ray would retry an absent cluster for minutes, after writing the run
    seed_everything(config.seed, config.deterministic)
    set_threads(config)
    task = task or make_task(config.task.name, **config.task.options)
    config = resolve_warm_start(config, task)
    reward_fn = build_rewards(config.task.rewards or task.rewards, defaults=reward_defaults(config))
    policy = policy_from_config(config)
    runner = EpisodeRunner(policy, task, config, reward_fn)
    test = held_out(task, config)
    learner = make_learner(policy, config)
    sampler, generator = PromptSampler(task.train, config.seed), torch.Generator().manual_seed(config.seed)
    run_dir = run_dir if run_dir is not None else run_dir_for(config)
    lock = lock_run_dir(run_dir)  # a second writer is refused before it touches the run's files
    try:
        checkpointer = LMCheckpointer(
            run_dir, config.checkpoint, config.model.name, policy, learner, sampler, generator
        )
        restored = None
        if checkpoint is not None:
            restored = resume_run(
                checkpointer,
                checkpoint,
                run_dir=run_dir,
                updates=config.train.updates,
                model_name=config.model.name,
                log=log,
            )
        logger = MetricsLogger(run_dir, tensorboard=config.log.tensorboard)
        logger.write_config(config.to_dict())
    except BaseException:
        lock.close()
        learner.close()
        raise
    progress = Progress(
        config.train.updates, enabled=config.log.progress, description=f"{config.algorithm} {task.name}"
    )
    run = LMRun(
        config,
        run_dir,
        policy,
        runner,
        test,
        learner,
        checkpointer,
        logger,
        progress,
        TripCounter(logger, config.rollback, config.estimator.target_kl),
        lock=lock,
    )
    if restored is not None:
        run.samples, run.train_seconds, run.history = restored
        run.first = checkpoint.step + 1
    try:
        run.offline = load_offline(config, runner, policy, log)
        run.episodes = EpisodeLog(run_dir) if config.log.episodes else None
        run.runtime = build_runtime(config, runner, sampler, generator, task, reward_fn, log)
    except BaseException:
        run.close()
        raise
    if checkpoint is not None:  # the episode counts go on, too
        run.runtime.rollout.resume_episodes(checkpoint.state.get("episodes"))
    return run


def resume_run(
    checkpointer: LMCheckpointer,
    checkpoint: Checkpoint,
    *,
    run_dir: Path,
    updates: int,
    model_name: str,
    log: Callable[[str], None],
) -> tuple[int, float, list]:
    """Load ``checkpoint`` into the run's objects and drop the metrics ``run_dir`` logged after it; its samples,
    train seconds and evaluation history. Warns if the reference model (``model_name`` now) changed."""
    restored = checkpointer.restore(checkpoint)
    if checkpoint.state["reference_model"] != model_name:
        log(
            f"warning: the checkpoint's reference model was {checkpoint.state['reference_model']}, the "
            f"configuration now loads {model_name}; the KL term is measured against the latter"
        )
    drop_metrics_after(run_dir, checkpoint.step)
    log(f"resuming {run_dir} from update {checkpoint.step} of {updates}")
    return restored


def log_update(run: LMRun, update: int, record: dict[str, float]) -> dict[str, float]:
    """Evaluate after ``update`` if it is due (every ``eval.every_updates`` and the last), log ``record`` if due,
    advance the progress bar; the evaluation (empty if none)."""
    config, updates = run.config, run.config.train.updates
    evaluation = {}
    if update % config.eval.every_updates == 0 or update == updates:
        with run.timer("eval"):
            evaluation = run_evaluation(run, update)
        run.history.append((update, evaluation))
        record.update(evaluation)
    if update % config.log.log_every_updates == 0 or update == updates or "eval/pass@1" in record:
        run.logger.log(update, record)
    run.progress.update(
        update, f"reward {record['rollout/reward_mean']:.3f} pass@1 {run.history[-1][1]['eval/pass@1']:.3f}"
    )
    return evaluation


def run_evaluation(run: LMRun, update: int) -> dict[str, float]:
    """The held-out evaluation after ``update`` (0: before training); the transcripts of its first
    ``eval.transcripts`` greedy episodes go to the run folder (``transcripts/eval_<update>.jsonl``)."""
    config = run.config
    evaluation, greedy = evaluate_episodes(
        run.runner, run.test, pass_k=config.eval.pass_k, seed=config.seed + 10_000 + update
    )
    if config.eval.transcripts:
        run.logger.transcripts(update, [transcript(trajectory) for trajectory in greedy[: config.eval.transcripts]])
    return evaluation


def train_updates(run: LMRun, stop: StopRequest) -> None:
    """Updates ``run.first`` … ``train.updates``, each evaluated and logged when due, rolled back after too many
    trips, checkpointed every ``checkpoint.every_updates``, at the end and when ``stop`` was asked for."""
    config, updates, every = run.config, run.config.train.updates, run.config.checkpoint.every_updates
    update = run.first
    while update <= updates:
        fraction = 1.0 - (update - 1) / updates if config.train.lr_schedule == "linear" else 1.0
        lr = run.learner.set_lr_fraction(fraction)
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
            )
        except ProducerFailed as failure:  # rollout cannot go on: keep what is trained, say how to go on
            raise ValueError(
                rollout_failed(
                    failure,
                    run.checkpointer,
                    update - 1,
                    run.saved,
                    run.samples,
                    run.train_seconds,
                    run.history,
                    run.episode_counts,
                )
            ) from failure
        run.episode_counts = step.rollout.episodes.state() if step.rollout.episodes is not None else None
        run.train_seconds += record["timing/step"]
        run.samples += size
        record.update({"train/learning_rate": lr, "train/samples": run.samples})
        evaluation = log_update(run, update, record)
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
    try:
        with StopRequest() as stop:
            if checkpoint is None:
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
            train_updates(run, stop)
        run.policy.save(run.run_dir / "policy")
    finally:
        run.close()
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
