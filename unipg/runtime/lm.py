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
end, and when Ctrl-C or SIGTERM stops the run after its current update. ``train_text(config, resume=RUN_DIR)``
continues from the newest one exactly as the uninterrupted run would have: weights, optimizer, KL coefficient,
learning-rate fraction, the prompt order and every random generator are restored (``unipg.checkpoint.lm``).

With ``rollback.enabled``, an update that trips (an optimizer step skipped for a non-finite loss or gradient, or
the whole update reverted for a KL spike, see ``unipg.learn.lm``) is logged as a ``skipped_update``
event in ``run/events.jsonl`` with a warning on standard error. After ``rollback.max_trips`` tripped updates in
a row the run goes back to its newest checkpoint (a fresh run saves one of update 0 for this, deleted when it
saves the next), multiplies the learning rate by ``rollback.lr_factor``, logs a ``rollback`` event and trains on
from there; the checkpoint's prompt order and random generators come back with it. metrics.jsonl keeps the
records of the updates given up, so its steps repeat after a rollback.
"""

from __future__ import annotations

import signal
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from unipg.checkpoint.lm import TextCheckpointer, drop_metrics_after, latest_checkpoint
from unipg.checkpoint.store import Checkpoint, load_checkpoint
from unipg.config import Config, RollbackConfig
from unipg.learn.lm import TextLearner
from unipg.learn.state import generator_state, restore_generator
from unipg.observe.metrics import (
    MetricsLogger,
    Progress,
    Timer,
    process_metrics,
    release_free_memory,
)
from unipg.policy.loading import policy_from_config
from unipg.runtime.backends.local_lm import TextRollout, inference_copy, rollout_batch
from unipg.runtime.driver import Runtime, WeightSync, resolve_schedule
from unipg.runtime.replay import ProducerFailed
from unipg.runtime.setup import run_dir_for, seed_everything, set_threads  # noqa: F401
from unipg.sample.episodes import (  # noqa: F401
    EpisodeRunner,
    PromptEncoder,
    episode_metrics,
    held_out,
    reward_term_metrics,
)
from unipg.sample.rewards.rules import build_rewards
from unipg.sample.tasks.base import Example, Task, make_task


@dataclass
class TextTrainResult:
    """What a finished text run reports."""

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


class PromptSampler:
    """Draws training examples without replacement, reshuffling after every pass over the split."""

    def __init__(self, examples: list[Example], seed: int):
        if not examples:
            raise ValueError("the task's training split is empty; give the task some training examples")
        self.examples, self.generator = examples, torch.Generator().manual_seed(seed)
        self._order: list[int] = []

    def next(self, count: int) -> list[Example]:
        chosen = []
        while len(chosen) < count:
            if not self._order:
                self._order = torch.randperm(len(self.examples), generator=self.generator).tolist()
            chosen.append(self.examples[self._order.pop()])
        return chosen

    def state(self) -> dict:
        """The position in the current pass and the shuffling generator, as JSON."""
        return {"order": list(self._order), "generator": generator_state(self.generator)}

    def load_state(self, state: dict) -> None:
        """Continue from a position given by ``state``."""
        self._order = list(state["order"])
        restore_generator(self.generator, state["generator"])


class TrainingStopped(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped a run after an update, and a checkpoint of that update was saved."""

    def __init__(self, run_dir: Path, update: int, signal_number: int):
        super().__init__(f"stopped after update {update}; continue with: unipg train --resume {run_dir}")
        self.run_dir, self.update, self.signal_number = run_dir, update, signal_number


class StopRequest:
    """Within ``with``: the first SIGINT or SIGTERM asks the run to stop after its current update (so that the
    checkpoint is of a whole update); a second SIGINT raises ``KeyboardInterrupt`` at once, saving nothing.

    Signal handlers can only be installed in the main thread; elsewhere signals keep their usual effect.
    """

    def __init__(self):
        self.signal_number: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for number in (signal.SIGINT, signal.SIGTERM):
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def _handle(self, number: int, frame) -> None:
        if self.signal_number is not None and number == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_number = number
        print(f"\n{signal.Signals(number).name}: stopping after the current update to save a checkpoint "
              "(Ctrl-C again stops at once, without saving)", file=sys.stderr, flush=True)


class TripCounter:
    """Counts consecutive tripped updates and records them and rollbacks as events of the run's logger."""

    def __init__(self, logger: MetricsLogger, settings: RollbackConfig, target_kl: float | None):
        self.logger, self.settings, self.target_kl = logger, settings, target_kl
        self.trips, self.rollbacks = 0, 0

    def observe(self, update: int, record: dict[str, float]) -> bool:
        """Count ``update`` by its metrics (``train/skipped_steps``, ``train/reverted``); whether the run must
        now roll back."""
        reasons = []
        if record.get("train/skipped_steps", 0.0) > 0:
            reasons.append(f"{record['train/skipped_steps']:.0f} optimizer step(s) with a non-finite loss or "
                           "gradient norm skipped")
        if record.get("train/reverted", 0.0) > 0:
            reasons.append(f"approx KL {record['train/approx_kl']:.3g} beyond {self.settings.kl_multiple:g} × "
                           f"target_kl {self.target_kl:g}, update reverted")
        if not reasons:
            self.trips = 0
            return False
        self.trips += 1
        reason = "; ".join(reasons)
        self.logger.event(update, "skipped_update", reason=reason, trips=self.trips,
                          warning=f"warning: update {update} tripped ({self.trips} of {self.settings.max_trips} "
                                  f"in a row): {reason}")
        return self.trips >= self.settings.max_trips

    def rolled_back(self, update: int, to_update: int, learning_rate_factor: float) -> None:
        """Record a rollback at ``update`` to the checkpoint of ``to_update``, and start counting afresh.

        Raises ValueError once the run has rolled back more than ``max_rollbacks`` times: it keeps diverging
        at ever smaller learning rates, so something other than the step size is wrong.
        """
        self.trips, self.rollbacks = 0, self.rollbacks + 1
        if self.rollbacks > self.settings.max_rollbacks:
            self.logger.event(update, "gave_up", rollbacks=self.rollbacks - 1)
            raise ValueError(f"updates keep tripping after {self.rollbacks - 1} rollbacks (learning rate now × "
                             f"{learning_rate_factor / self.settings.lr_factor:g}); see {self.logger.events_path} — "
                             "check the rewards for non-finite values, or lower train.learning_rate")
        self.logger.event(update, "rollback", to_update=to_update, learning_rate_factor=learning_rate_factor,
                          warning=f"warning: {self.settings.max_trips} tripped updates in a row; rolled back to "
                                  f"update {to_update} with the learning rate × {learning_rate_factor:g}")


def columns_of(examples: list[Example]) -> dict[str, list]:
    """Per-example columns as aligned lists, the keyword arguments of the reward functions."""
    names = {name for example in examples for name in example.columns}
    return {name: [example.columns.get(name) for example in examples] for name in sorted(names)}


def evaluate_text(runner: EpisodeRunner, examples: list[Example], config: Config, *, seed: int) -> dict[str, float]:
    """Greedy episodes on held-out examples — pass@1 is the task completion rate (the final answer equals the
    reference), with turns and tool use — and sampled pass@k (solved by any of k sampled episodes)."""
    greedy = runner.run(examples, params=runner.sampling(greedy=True), generator=None)
    metrics = {"eval/pass@1": statistics.fmean(t.correct for t in greedy)}
    metrics.update({key: value for key, value in episode_metrics(greedy, "eval", tools=runner.service is not None).items()
                    if key != "eval/completion_rate"})
    metrics.update(runner.pop_service_metrics("eval"))
    k = config.eval.pass_k
    if k > 0:
        generator = torch.Generator().manual_seed(seed)
        sampled = runner.run([example for example in examples for _ in range(k)], params=runner.sampling(),
                             generator=generator)
        solved = [any(t.correct for t in sampled[i * k:(i + 1) * k]) for i in range(len(examples))]
        metrics[f"eval/pass@{k}"] = statistics.fmean(solved)
        runner.pop_service_metrics("eval")
    return metrics


def build_runtime(config: Config, runner: EpisodeRunner, sampler: PromptSampler, generator: torch.Generator,
                  task: Task, reward_fn, log: Callable[[str], None] = print) -> Runtime:
    """The runtime of a text run: sequential on the learner's own weights, or concurrent on a synced copy
    with its own episode runner (tools and environment service included); with ``backend: ray``, on rollout
    workers and environment actors of a Ray cluster (``unipg.runtime.backends.ray_lm``)."""
    settings = config.runtime
    schedule = resolve_schedule(settings.schedule, settings.max_staleness, config.deterministic)
    if config.backend == "ray":
        from unipg.runtime.backends.ray_lm import RayRollout

        rollout = RayRollout(runner, sampler, config, generator, task, log=log)
    elif schedule == "concurrent":
        copy = inference_copy(runner.policy)
        rollout = TextRollout(EpisodeRunner(copy, task, config, reward_fn), sampler, generator,
                              WeightSync(runner.policy.model, copy.model), owns_runner=True,
                              group_size=config.sample.samples_per_prompt, concurrency=config.agent.concurrency)
    else:
        rollout = TextRollout(runner, sampler, generator, group_size=config.sample.samples_per_prompt,
                              concurrency=config.agent.concurrency)
    try:
        return Runtime(rollout, groups_per_step=config.prompts_per_step, group_size=config.sample.samples_per_prompt,
                       max_staleness=settings.max_staleness, capacity=config.sample.replay_buffer_size,
                       schedule=schedule, sampling=settings.sampling, eviction=settings.eviction,
                       freshness_decay=settings.freshness_decay, seed=config.seed)
    except ValueError:
        rollout.close()
        raise


def rollout_failed(failure: ProducerFailed, checkpointer: TextCheckpointer, update: int, saved: int | None,
                   samples: int, train_seconds: float, history: list) -> str:
    """After rollout failed for good: save a checkpoint of the last finished ``update`` unless ``saved`` is it,
    and the failure's whole traceback to ``run_dir/rollout_error.txt``; the one-line message of the run's end,
    saying where to continue from."""
    run_dir = checkpointer.store.root.parent
    if update > 0 and saved != update:
        checkpointer.save(update, samples=samples, train_seconds=train_seconds, history=history, metrics={})
        saved = update
    trace = run_dir / "rollout_error.txt"  # the message is one line; the traceback is what debugging needs
    trace.write_text("".join(traceback.format_exception(failure)), encoding="utf-8")
    where = (f"a checkpoint of update {saved} is in {run_dir}; continue with: unipg train --resume {run_dir}"
             if saved else f"no update had finished; the metrics so far are in {run_dir}")
    return f"{failure}; {where} (traceback: {trace})"


def finished_run(run_dir: Path, checkpoint: Checkpoint) -> TextTrainResult:
    """The result of a run whose newest ``checkpoint`` is already at ``train.updates``: nothing more is trained."""
    history = [(at, evaluation) for at, evaluation in checkpoint.state["eval_history"]]
    return TextTrainResult(run_dir, checkpoint.step, checkpoint.state["samples"], 0.0, history[0][1], history[-1][1],
                           history, checkpoint.state["train_seconds"], resumed_from=checkpoint.step)


def train_step(runtime: Runtime, learner: TextLearner, timer: Timer, update: int, *, group_size: int,
               tools: bool) -> tuple[dict[str, float], int]:
    """Update ``update``: the next groups (of ``group_size`` episodes, with tool calls if ``tools``) from the
    runtime, their reference log-probs and values, the estimator's epochs of mini-batch steps, the new weights
    published. Its record (rollout, train, timing and system metrics) and its number of samples;
    ``ProducerFailed`` when rollout cannot go on (from ``next_groups``, before anything of the update is done)."""
    start = time.time()
    groups, record = runtime.next_groups(update - 1)
    batch, rollout_record = rollout_batch(groups, runtime.rollout, update - 1, record["timing/learner_wait"],
                                          group_size=group_size, pad_id=learner.policy.pad_id, tools=tools)
    record.update(rollout_record)
    with timer("logprob"):
        record.update({f"train/{k}": v for k, v in learner.prepare(batch).items()})
    with timer("update"):
        record.update({f"train/{k}": v for k, v in learner.update(batch).items()})
    runtime.publish(update)
    seconds = time.time() - start
    record.update(timer.pop())
    release_free_memory()  # freed heap pages go back to the system, so system/rss_mb follows what is in use
    record.update(process_metrics())
    record.update({"timing/step": seconds, "timing/samples_per_second": len(batch.scores) / seconds,
                   "timing/tokens_per_second": record["rollout/generated_tokens"] / seconds})
    return record, len(batch.scores)


def roll_back(update: int, checkpointer: TextCheckpointer, runtime: Runtime,
              trips: TripCounter) -> tuple[int, int, list]:
    """After ``update`` tripped ``rollback.max_trips`` times in a row: stop rollout, restore the newest intact
    checkpoint with the learning rate lowered by ``rollback.lr_factor``, restart rollout from it. The checkpoint's
    update, and the samples and evaluation history as of it."""
    learner = checkpointer.learner
    factor = learner.lr_factor * trips.settings.lr_factor
    latest = checkpointer.store.latest()
    if latest is None:
        raise ValueError(f"updates keep tripping and no intact checkpoint is left in {checkpointer.store.root} to "
                         f"roll back to; see {trips.logger.events_path}")
    good = load_checkpoint(latest)
    runtime.close()  # rollout stops before its prompt order and weights are set back
    samples, _, history = checkpointer.restore(good)
    learner.lr_factor = factor
    trips.rolled_back(update, good.step, factor)
    runtime.reset(good.step)
    return good.step, samples, history


def train_text(config: Config, *, task: Task | None = None, resume: str | Path | None = None,
               log: Callable[[str], None] = print) -> TextTrainResult:
    """Train ``config.model.name`` on ``config.task.name`` with the configured estimator.

    With ``resume`` (the folder of an earlier run), continue that run from its newest checkpoint, appending to
    its metrics.jsonl; a run whose checkpoint is already at ``train.updates`` is reported and not trained.
    """
    from unipg.learn.warm_start import resolve_warm_start

    updates = config.train.updates
    checkpoint = latest_checkpoint(Path(resume)) if resume is not None else None
    if checkpoint is not None and checkpoint.step >= updates:
        log(f"run {resume} already finished at update {checkpoint.step} of {updates}; raise train.updates "
            "to train further")
        return finished_run(Path(resume), checkpoint)
    seed_everything(config.seed, config.deterministic)
    set_threads(config)
    task = task or make_task(config.task.name, **config.task.options)
    config = resolve_warm_start(config, task)
    reward_fn = build_rewards(config.task.rewards or task.rewards)
    policy = policy_from_config(config)
    runner = EpisodeRunner(policy, task, config, reward_fn)
    test = held_out(task, config)
    learner = TextLearner(policy, config)
    sampler, generator = PromptSampler(task.train, config.seed), torch.Generator().manual_seed(config.seed)
    run_dir = Path(resume) if resume is not None else run_dir_for(config)
    checkpointer = TextCheckpointer(run_dir, config, policy, learner, sampler, generator)
    first, samples, train_seconds = 1, 0, 0.0
    if checkpoint is not None:
        samples, train_seconds, history = checkpointer.restore(checkpoint)
        if checkpoint.state["reference_model"] != config.model.name:
            log(f"warning: the checkpoint's reference model was {checkpoint.state['reference_model']}, the "
                f"configuration now loads {config.model.name}; the KL term is measured against the latter")
        first = checkpoint.step + 1
        drop_metrics_after(run_dir, checkpoint.step)
        log(f"resuming {run_dir} from update {checkpoint.step} of {updates}")
    logger = MetricsLogger(run_dir, tensorboard=config.log.tensorboard)
    logger.write_config(config.to_dict())
    progress = Progress(updates, enabled=config.log.progress, description=f"{config.algorithm} {task.name}")
    timer, start, every = Timer(), time.time(), config.checkpoint.every_updates
    trips = TripCounter(logger, config.rollback, config.estimator.target_kl)
    try:
        runtime = build_runtime(config, runner, sampler, generator, task, reward_fn, log)
    except BaseException:
        runner.close()
        progress.close()
        logger.close()
        raise
    checkpointer.episode_state = runtime.rollout.episode_state
    if checkpoint is not None:  # the episode counts go on, too
        runtime.rollout.resume_episodes(checkpoint.state.get("episodes"))
    try:
        with StopRequest() as stop:
            if checkpoint is None:
                initial = evaluate_text(runner, test, config, seed=config.seed + 10_000)
                history = [(0, initial)]
                logger.log(0, initial)
                if config.rollback.enabled:  # something to roll back to before the first periodic checkpoint
                    checkpointer.save(0, samples=0, train_seconds=0.0, history=history, metrics={})
            runtime.reset(first - 1)  # rollout starts from the weights (and prompt order) training starts from
            saved = first - 1 if checkpoint is not None or config.rollback.enabled else None
            update = first
            while update <= updates:
                fraction = 1.0 - (update - 1) / updates if config.train.lr_schedule == "linear" else 1.0
                lr = learner.set_lr_fraction(fraction)
                try:
                    record, size = train_step(runtime, learner, timer, update,
                                              group_size=config.sample.samples_per_prompt,
                                              tools=runner.service is not None)
                except ProducerFailed as failure:  # rollout cannot go on: keep what is trained, say how to go on
                    raise ValueError(rollout_failed(failure, checkpointer, update - 1, saved, samples,
                                                    train_seconds, history)) from failure
                train_seconds += record["timing/step"]
                samples += size
                record.update({"train/learning_rate": lr, "train/samples": samples})
                evaluation = {}
                if update % config.eval.every_updates == 0 or update == updates:
                    with timer("eval"):
                        evaluation = evaluate_text(runner, test, config, seed=config.seed + 10_000 + update)
                    history.append((update, evaluation))
                    record.update(evaluation)
                if update % config.log.log_every_updates == 0 or update == updates or "eval/pass@1" in record:
                    logger.log(update, record)
                progress.update(update, f"reward {record['rollout/reward_mean']:.3f} "
                                        f"pass@1 {history[-1][1]['eval/pass@1']:.3f}")
                if trips.observe(update, record):
                    good, samples, history = roll_back(update, checkpointer, runtime, trips)
                    update = good + 1
                    continue
                stopping = stop.signal_number is not None and update < updates
                if stopping or update == updates or (every and update % every == 0):
                    checkpointer.save(update, samples=samples, train_seconds=train_seconds, history=history,
                                      metrics=evaluation)
                    saved = update
                if stopping:
                    raise TrainingStopped(run_dir, update, stop.signal_number)
                update += 1
        policy.save(run_dir / "policy")
    finally:
        runtime.close()
        runtime.rollout.close()
        runner.close()
        progress.close()
        logger.close()
    return TextTrainResult(run_dir, updates, samples, time.time() - start, history[0][1], history[-1][1], history,
                           train_seconds, resumed_from=first - 1)
