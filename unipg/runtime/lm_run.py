"""An lm run's parts and how they are built: ``open_run`` seeds the run, builds the policy, learner, checkpointer,
logger and runtime (``LMRun``), and continues a checkpoint when resuming; ``unipg.runtime.lm`` trains with them."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import torch

from unipg.checkpoint.lm import LMCheckpointer, drop_metrics_after
from unipg.checkpoint.store import Checkpoint
from unipg.config import Config
from unipg.learn.lm import LMLearner
from unipg.observe.episodes import SUPERSEDED_FILE, EpisodeLog, supersede_episodes_after
from unipg.observe.metrics import MetricsLogger, Progress, Timer
from unipg.observe.rollout_metrics import uniform_groups
from unipg.policy.lm import LMPolicy
from unipg.policy.loading import policy_from_config
from unipg.runtime.backends import BACKEND_INPUTS, BACKENDS, make_learner
from unipg.runtime.driver import Runtime, resolve_schedule
from unipg.runtime.offline import OfflineData, load_offline
from unipg.runtime.prompts import PromptSampler
from unipg.runtime.replay import Group
from unipg.runtime.setup import check_ray_address, lock_run_dir, run_dir_for, seed_everything, set_threads
from unipg.runtime.stopping import TripCounter
from unipg.sample.episodes import EpisodeRunner, build_task, held_out
from unipg.tasks.base import Example, Task
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
            rollout_timeout=settings.rollout_timeout,
        )
    except ValueError:
        rollout.close()
        raise


def mixed_returns(group: Group) -> bool:
    """Whether the returns of ``group``'s episodes of some role differ (``uniform_groups``), so that a group-relative
    advantage is not zero for all of them: the test of dynamic sampling (``sample.dynamic_sampling``)."""
    return not all(uniform_groups([t.reward for t in group.items], group.size))


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


@dataclass
class LMRun:
    """The parts of an lm run as ``train_lm`` builds them (``open_run``), and its running totals."""

    config: Config  # warm start resolved
    run_dir: Path
    policy: LMPolicy
    runner: EpisodeRunner  # the learner's; evaluation runs on it, and sequential rollout too
    test: list[Example]  # the test examples evaluation reports on (eval/…); no decision reads them
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
    validation: list[Example] = field(default_factory=list)  # what decisions read (val/…: checkpoint.best_metric)

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
    task = build_task(config, task)
    config = resolve_warm_start(config, task)
    reward_fn = build_rewards(config.task.rewards or task.rewards, defaults=reward_defaults(config))
    policy = policy_from_config(config, list(task.roles))
    runner = EpisodeRunner(policy, task, config, reward_fn)
    test = held_out(task, config)
    learner = make_learner(policy, config)
    sampler, generator = PromptSampler(task.train, config.seed), torch.Generator().manual_seed(config.seed)
    run_dir = run_dir if run_dir is not None else run_dir_for(config)
    run = start_run(config, task, run_dir, checkpoint, log, policy, runner, learner, (sampler, generator))
    run.test, run.validation = test, task.validation
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


def start_run(
    config: Config,
    task: Task,
    run_dir: Path,
    checkpoint: Checkpoint | None,
    log: Callable[[str], None],
    policy: LMPolicy,
    runner: EpisodeRunner,
    learner: LMLearner,
    prompt_order: tuple[PromptSampler, torch.Generator],
) -> LMRun:
    """Lock ``run_dir``, open the run's checkpointer and logger, and continue ``checkpoint`` if given: the
    ``LMRun`` without its runtime."""
    sampler, generator = prompt_order
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
    description = f"{config.algorithm} {task.name}"
    progress = Progress(config.train.updates, enabled=config.log.progress, description=description)
    trips = TripCounter(logger, config.rollback, config.estimator.target_kl)
    run = LMRun(config, run_dir, policy, runner, [], learner, checkpointer, logger, progress, trips, lock=lock)
    if restored is not None:
        run.samples, run.train_seconds, run.history = restored
        run.first = checkpoint.step + 1
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
    """Load ``checkpoint`` into the run's objects, drop the metrics ``run_dir`` logged after it and move its episode
    records after it aside (``supersede_episodes_after``); its samples,
    train seconds and evaluation history. Warns if the reference model (``model_name`` now) changed."""
    restored = checkpointer.restore(checkpoint)
    if checkpoint.state["reference_model"] != model_name:
        log(
            f"warning: the checkpoint's reference model was {checkpoint.state['reference_model']}, the "
            f"configuration now loads {model_name}; the KL term is measured against the latter"
        )
    drop_metrics_after(run_dir, checkpoint.step)
    moved = supersede_episodes_after(run_dir, checkpoint.step)
    if moved:
        log(f"moved {moved} episode records of updates after {checkpoint.step} to {SUPERSEDED_FILE}")
    log(f"resuming {run_dir} from update {checkpoint.step} of {updates}")
    return restored
