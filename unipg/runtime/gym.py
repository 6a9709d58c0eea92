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

A run's parts (``GymRun``) are built by ``open_gym_run`` (``unipg.runtime.gym_run``); here ``train_update`` is one
learner step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

from unipg.checkpoint.files import Checkpoint
from unipg.checkpoint.lm import latest_checkpoint
from unipg.config import Config
from unipg.config.timeouts import WaitTimeout
from unipg.learn.gym import prepare_segment
from unipg.observe.gym_metrics import rollout_metrics
from unipg.observe.metrics import Progress
from unipg.policy.mlp import MLPActorCritic
from unipg.runtime.gym_run import GymRun, GymTrainResult, finished_run, open_gym_run
from unipg.runtime.replay import ProducerFailed
from unipg.runtime.setup import locked_run_dir, run_dir_for
from unipg.sample.gym_rollout import evaluate_policy


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
        try:
            (group,), step = g.runtime.next_groups(version)
        except ProducerFailed as failure:
            if isinstance(failure.__cause__, WaitTimeout):  # the rollout thread is stuck: one line, no traceback
                raise failure.__cause__ from None
            raise
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
