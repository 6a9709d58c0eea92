"""A gym run's parts and how they are built: ``open_gym_run`` seeds the run and builds its environments, policy,
learner, runtime, checkpointer and logger (``GymRun``), and continues a checkpoint when resuming; the counters a run
keeps (``Progression``) and what it reports (``GymTrainResult``). ``unipg.runtime.gym`` trains with them."""

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
from unipg.config import Config
from unipg.learn.gym import bootstraps, make_learner
from unipg.observe.gym_metrics import RuntimeMeter
from unipg.observe.metrics import MetricsLogger, Timer
from unipg.policy.mlp import MLPActorCritic
from unipg.runtime.backends.local_gym import GymSegments
from unipg.runtime.driver import Runtime, resolve_schedule
from unipg.runtime.setup import seed_everything
from unipg.sample.gym_rollout import GymRollout, RolloutBatch


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
        rollout_timeout=settings.rollout_timeout,
    )
