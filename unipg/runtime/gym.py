"""Training of MLP policies on gymnasium environments, synchronous or with bounded staleness.

The loop reads top to bottom: take the next rollout segment from the runtime, estimate advantages,
update, publish the new weights, evaluate now and then, log. Which algorithm runs is decided entirely by the
config (advantage estimator, policy loss, update rule), so REINFORCE, A2C, PPO and TRPO share this one loop.

Segments come from ``unipg.runtime.driver.Runtime`` (see ``unipg.runtime.backends.local_gym``): with
``runtime.max_staleness`` = 0, the default, each segment is collected with the weights the learner step
starts from — synchronous training; with η > 0 a segment may be up to η learner versions old (exactly η
in the ``sequential`` schedule once the first η steps are done), and the learner corrects for it
(``unipg.learn.gym.prepare_segment``, the off-policy weight, ``decoupled_ppo``). Environment steps
count when the learner trains on them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from unipg.checkpoint.files import Checkpoint
from unipg.checkpoint.gym import GymCheckpointer, keep_metrics
from unipg.checkpoint.lm import latest_checkpoint
from unipg.config import Config
from unipg.learn.gym import bootstraps, make_learner, prepare_segment
from unipg.observe.gym_metrics import RuntimeMeter, rollout_metrics
from unipg.observe.metrics import MetricsLogger, Progress, Timer
from unipg.policy.mlp import MLPActorCritic
from unipg.runtime.backends.local_gym import GymSegments
from unipg.runtime.driver import Runtime, resolve_schedule
from unipg.runtime.setup import locked_run_dir, run_dir_for, seed_everything
from unipg.sample.gym_rollout import GymRollout, RolloutBatch, evaluate_policy


@dataclass
class GymTrainResult:
    """What a finished run reports: its folder, final figures and the evaluation history."""

    run_dir: Path
    env_steps: int
    episodes: int
    wall_seconds: float
    final_eval_mean: float
    final_eval_std: float
    steps_to_eval_threshold: int | None  # first evaluation step whose mean reached the threshold
    steps_to_train_threshold: int | None  # first step at which the last 100 training episodes averaged ≥ it
    eval_history: list[tuple[int, float]] = field(default_factory=list)  # (step, mean return)
    final_train_return: float | None = None

    @property
    def steps_per_second(self) -> float:
        return self.env_steps / max(self.wall_seconds, 1e-9)


@dataclass
class Progression:
    """Counters of a run and the first steps at which it reached a return threshold."""

    threshold: float | None
    env_steps: int = 0
    episodes: int = 0
    recent_returns: list[float] = field(default_factory=list)  # the last 100 training episodes
    eval_history: list[tuple[int, float]] = field(default_factory=list)
    last_eval: list[float] = field(default_factory=lambda: [float("nan")])
    steps_to_eval_threshold: int | None = None
    steps_to_train_threshold: int | None = None

    def add_rollout(self, batch: RolloutBatch) -> None:
        self.env_steps += batch.num_steps
        self.episodes += len(batch.episode_returns)
        self.recent_returns = (self.recent_returns + batch.episode_returns)[-100:]
        if (
            self.threshold is not None
            and self.steps_to_train_threshold is None
            and len(self.recent_returns) == 100
            and statistics.fmean(self.recent_returns) >= self.threshold
        ):
            self.steps_to_train_threshold = self.env_steps

    def add_eval(self, returns: list[float]) -> dict[str, float]:
        self.last_eval = returns
        mean = statistics.fmean(returns)
        self.eval_history.append((self.env_steps, mean))
        if self.threshold is not None and self.steps_to_eval_threshold is None and mean >= self.threshold:
            self.steps_to_eval_threshold = self.env_steps
        return {"eval/return_mean": mean, "eval/return_std": statistics.pstdev(returns)}

    def state(self) -> dict:
        return {
            "env_steps": self.env_steps,
            "episodes": self.episodes,
            "recent_returns": self.recent_returns,
            "eval_history": [list(entry) for entry in self.eval_history],
            "last_eval": self.last_eval,
            "steps_to_eval_threshold": self.steps_to_eval_threshold,
            "steps_to_train_threshold": self.steps_to_train_threshold,
        }

    @classmethod
    def from_state(cls, threshold: float | None, state: dict) -> Progression:
        run = cls(threshold, **{key: value for key, value in state.items() if key != "eval_history"})
        run.eval_history = [(step, mean) for step, mean in state["eval_history"]]
        return run

    @property
    def train_return(self) -> float | None:
        return statistics.fmean(self.recent_returns) if self.recent_returns else None


def train_gym(
    config: Config,
    *,
    return_threshold: float | None = None,
    resume: str | Path | None = None,
    log: Callable[[str], None] = print,
) -> GymTrainResult:
    """Train an MLP policy on ``config.env.id``; ``return_threshold`` marks when the return first reaches it.

    With ``resume`` (the folder of an earlier run), continue that run from its newest checkpoint, cutting its
    metrics.jsonl back to the records written up to that checkpoint."""
    checkpoint = latest_checkpoint(Path(resume)) if resume is not None else None
    with locked_run_dir(Path(resume) if resume is not None else run_dir_for(config)) as run_dir:
        if checkpoint is not None:
            updates = config.env.total_steps // config.train.batch_transitions
            if checkpoint.step >= updates:
                log(
                    f"run {run_dir} already finished at update {checkpoint.step} of {updates}; raise "
                    "env.total_steps to train further"
                )
                return finished_run(run_dir, checkpoint, return_threshold)
        return train_gym_in(run_dir, config, return_threshold, checkpoint, log)


def finished_run(run_dir: Path, checkpoint: Checkpoint, threshold: float | None) -> GymTrainResult:
    """The result of a run that ``checkpoint`` shows finished, from its counters."""
    run = Progression.from_state(threshold, checkpoint.state["run"]["progression"])
    return GymTrainResult(
        run_dir,
        run.env_steps,
        run.episodes,
        0.0,
        statistics.fmean(run.last_eval),
        statistics.pstdev(run.last_eval),
        run.steps_to_eval_threshold,
        run.steps_to_train_threshold,
        run.eval_history,
        run.train_return,
    )


@dataclass
class GymRun:
    """The objects of a gym run and the counters a checkpoint keeps."""

    config: Config
    rollout: GymRollout
    policy: MLPActorCritic
    learner: Any
    runtime: Runtime
    logger: MetricsLogger
    checkpointer: GymCheckpointer
    run: Progression
    num_updates: int
    next_eval: int
    records: int = 0  # metrics records written by the run so far (resumed runs included)
    first: int = 1  # the first update to train
    timer: Timer = field(default_factory=Timer)
    meter: RuntimeMeter = field(default_factory=lambda: RuntimeMeter())
    start: float = field(default_factory=time.time)

    def log(self, step: int, record: dict[str, float]) -> None:
        self.logger.log(step, record)
        self.records += 1

    def state(self) -> dict:
        return {"progression": self.run.state(), "next_eval": self.next_eval, "records": self.records}


def open_gym_run(
    run_dir: Path, config: Config, threshold: float | None, checkpoint: Checkpoint | None, log: Callable[[str], None]
) -> GymRun:
    """Seed and build a run's objects; continue ``checkpoint`` if given."""
    seed_everything(config.seed, config.deterministic)
    # MLPs this small run fastest on one thread: intra-op parallelism costs more than it saves.
    torch.set_num_threads(config.threads or 1)
    rollout = GymRollout(
        config.env.id,
        config.env.num_envs,
        seed=config.seed,
        gamma=config.estimator.gamma,
        max_episode_steps=config.env.max_episode_steps,
        normalize_rewards=config.estimator.normalize_rewards,
    )
    policy = MLPActorCritic(
        rollout.observation_space,
        rollout.action_space,
        hidden_sizes=config.policy.hidden_sizes,
        activation=config.policy.activation,
        log_std_init=config.policy.log_std_init,
    )
    learner = make_learner(policy, config)
    runtime = make_runtime(config, rollout, policy)
    checkpointer = GymCheckpointer(
        run_dir, config.checkpoint, config.env.id, policy, learner, rollout, replay_random=runtime.buffer.random
    )
    num_updates = config.env.total_steps // config.train.batch_transitions
    run = GymRun(
        config,
        rollout,
        policy,
        learner,
        runtime,
        None,
        checkpointer,
        Progression(threshold),
        num_updates,
        config.eval.every_steps,
    )
    if checkpoint is not None:
        try:
            saved, pending = checkpointer.restore(checkpoint)
        except BaseException:
            rollout.close()
            raise
        run.run, run.next_eval = Progression.from_state(threshold, saved["progression"]), saved["next_eval"]
        run.records, run.first = saved["records"], checkpoint.step + 1
        for record, ages, masks in pending:
            run.meter.add(record, {"age": ages, "mask": masks})
        keep_metrics(run_dir, run.records, dropped=saved.get("dropped", []))
        run.records -= len(saved.get("dropped", []))
        log(f"resuming {run_dir} from update {checkpoint.step} of {num_updates}")
    run.logger = MetricsLogger(run_dir, tensorboard=config.log.tensorboard)
    run.logger.write_config(config.to_dict())
    return run


def train_gym_in(
    run_dir: Path,
    config: Config,
    return_threshold: float | None,
    checkpoint: Checkpoint | None = None,
    log: Callable[[str], None] = print,
) -> GymTrainResult:
    """``train_gym`` in the locked folder ``run_dir``."""
    g = open_gym_run(run_dir, config, return_threshold, checkpoint, log)
    progress = Progress(config.env.total_steps, enabled=config.log.progress, description=config.algorithm)
    try:
        g.runtime.start()
        if g.first > 1:
            g.runtime.reset(g.first - 1)  # the gate and the rollout continue from the checkpoint's version
        for update in range(g.first, g.num_updates + 1):
            train_update(g, update)
            progress.update(g.run.env_steps, f"return {g.run.train_return:.1f}" if g.run.recent_returns else "")
    finally:
        g.runtime.close()  # the concurrent schedule's rollout thread stops before its environments close
        progress.close()
        g.logger.close()
        g.rollout.close()
    run = g.run
    return GymTrainResult(
        run_dir,
        run.env_steps,
        run.episodes,
        time.time() - g.start,
        statistics.fmean(run.last_eval),
        statistics.pstdev(run.last_eval),
        run.steps_to_eval_threshold,
        run.steps_to_train_threshold,
        run.eval_history,
        run.train_return,
    )


def train_update(g: GymRun, update: int) -> None:
    """One learner step: a segment, its advantages, the update, evaluation and logging when due, a checkpoint
    when due, and on the last update the closing evaluation and log line (after the checkpoint, which does not
    count them: a longer run resumed from it does not have them)."""
    config, run, timer = g.config, g.run, g.timer
    version = update - 1  # learner steps published so far
    lr = g.learner.set_lr_fraction(1.0 - (update - 1) / g.num_updates if config.train.lr_schedule == "linear" else 1.0)
    with timer("rollout"):  # collecting (sequential) or waiting for a segment (concurrent)
        (group,), step = g.runtime.next_groups(version)
    batch = group.items[0]
    run.add_rollout(batch)
    with timer("advantage"):
        segment = prepare_segment(g.policy, batch, config.estimator, age=group.age(version))
    with timer("update"):
        metrics = g.learner.update(segment.samples)
    g.meter.add(step.metrics(), segment.samples)
    is_last = update == g.num_updates
    before = g.state(), g.meter.pending()  # what a checkpoint keeps of a closing evaluation or log line: nothing
    eval_due, log_due = run.env_steps >= g.next_eval, update % config.log.log_every_updates == 0
    evaluated = evaluate_and_log(g) if eval_due or is_last else {}
    if eval_due:
        g.next_eval += config.eval.every_steps
    if log_due or is_last:
        log_train(g, update, metrics, segment, lr)
    if g.checkpointer.due(update, is_last):
        save_checkpoint(
            g, update, before, evaluated, closing_eval=is_last and not eval_due, closing_log=is_last and not log_due
        )
    # Published after evaluating: a concurrent rollout then never draws random numbers while a
    # stochastic evaluation does, so at η = 0 both schedules give the same run.
    g.runtime.publish(update)


def save_checkpoint(
    g: GymRun,
    update: int,
    before: tuple[dict, list],
    evaluated: dict[str, float],
    *,
    closing_eval: bool,
    closing_log: bool,
) -> None:
    """Save after ``update``. The closing evaluation and log line of a last update that were not due (a longer
    run does not have them) are left out: the run's figures from ``before`` them, their records listed in
    ``dropped`` for a resumed run to remove from metrics.jsonl."""
    state, pending, dropped = g.state(), g.meter.pending(), []
    if closing_eval:  # this update's records start with its evaluation
        state["progression"] = before[0]["progression"]
        dropped.append(before[0]["records"])
    if closing_log:  # and end with its log line
        pending = before[1]
        dropped.append(g.records - 1)
    state["dropped"] = dropped
    g.checkpointer.save(update, state, pending=pending, metrics={} if closing_eval else evaluated)


def evaluate_and_log(g: GymRun) -> dict[str, float]:
    with g.timer("eval"):
        returns_eval = evaluate_gym(g.policy, g.config, seed=g.config.seed + 10_000 + g.run.env_steps)
    record = g.run.add_eval(returns_eval)
    g.log(g.run.env_steps, record)
    return record


def log_train(g: GymRun, update: int, metrics: dict[str, float], segment, lr: float) -> None:
    record = {f"train/{k}": v for k, v in metrics.items()}
    record.update(rollout_metrics(segment.batch, segment.advantages, segment.returns, g.run.recent_returns))
    record.update(
        {
            "train/learning_rate": lr,
            "train/update": update,
            "train/episodes": g.run.episodes,
            "timing/steps_per_second": g.run.env_steps / (time.time() - g.start),
        }
    )
    record.update(g.timer.pop())
    record.update(g.meter.pop())
    g.log(g.run.env_steps, record)


def evaluate_gym(policy: MLPActorCritic, config: Config, *, seed: int) -> list[float]:
    """The returns of ``eval.episodes`` evaluation episodes on a fresh environment seeded with ``seed``."""
    return evaluate_policy(
        policy,
        config.env.id,
        episodes=config.eval.episodes,
        seed=seed,
        deterministic=config.eval.deterministic,
        max_episode_steps=config.env.max_episode_steps,
    )


def make_runtime(config: Config, rollout: GymRollout, policy: MLPActorCritic) -> Runtime:
    """The runtime of a gym run: one segment per learner step, ``sample.replay_buffer_size`` segments
    of buffer, the schedule resolved from ``runtime.schedule`` (``auto``: sequential when η = 0)."""
    settings = config.runtime
    schedule = resolve_schedule(settings.schedule, settings.max_staleness, config.deterministic)
    segments = GymSegments(
        rollout,
        policy,
        steps_per_env=config.steps_per_env,
        bootstrap=bootstraps(config.estimator),
        concurrent=schedule == "concurrent",
    )
    return Runtime(
        segments,
        groups_per_step=1,
        group_size=1,
        max_staleness=settings.max_staleness,
        capacity=config.sample.replay_buffer_size,
        schedule=schedule,
        sampling=settings.sampling,
        eviction=settings.eviction,
        freshness_decay=settings.freshness_decay,
        seed=config.seed,
    )
