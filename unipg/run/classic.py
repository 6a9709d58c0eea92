"""Synchronous training of MLP policies on gymnasium environments.

The loop reads top to bottom: collect a rollout with the current policy, estimate advantages, update,
evaluate now and then, log. Which algorithm runs is decided entirely by the config (advantage estimator,
policy loss, update rule), so REINFORCE, A2C, PPO and TRPO share this one loop.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from unipg.config import Config
from unipg.estimate.masked import masked_mean, masked_var
from unipg.policy.mlp import MLPActorCritic
from unipg.run.learner import bootstraps, compute_advantages, flatten_batch, make_learner
from unipg.estimate.losses import explained_variance
from unipg.run.metrics import MetricsLogger, Progress, Timer
from unipg.sample.gym_rollout import GymRollout, evaluate_policy


@dataclass
class TrainResult:
    """What a finished run reports: its folder, final figures and the evaluation history."""

    run_dir: Path
    env_steps: int
    episodes: int
    wall_seconds: float
    final_eval_mean: float
    final_eval_std: float
    steps_to_threshold: int | None  # first evaluation step whose mean reached the threshold
    eval_history: list[tuple[int, float]] = field(default_factory=list)  # (step, mean return)
    final_train_return: float | None = None

    @property
    def steps_per_second(self) -> float:
        return self.env_steps / max(self.wall_seconds, 1e-9)


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def run_dir_for(config: Config) -> Path:
    name = config.log.run_name or f"{config.algorithm}-{config.env.id}-seed{config.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    return Path(config.log.output_dir) / name


def train_classic(config: Config, *, return_threshold: float | None = None) -> TrainResult:
    """Train an MLP policy on ``config.env.id``; ``return_threshold`` marks the first evaluation ≥ it."""
    seed_everything(config.seed, config.deterministic)
    # MLPs this small run fastest on one thread: intra-op parallelism costs more than it saves.
    torch.set_num_threads(1)
    rollout = GymRollout(config.env.id, config.env.num_envs, seed=config.seed, gamma=config.estimator.gamma,
                         max_episode_steps=config.env.max_episode_steps,
                         normalize_rewards=config.estimator.normalize_rewards)
    policy = MLPActorCritic(rollout.observation_space, rollout.action_space,
                            hidden_sizes=config.policy.hidden_sizes, activation=config.policy.activation,
                            log_std_init=config.policy.log_std_init)
    learner = make_learner(policy, config)
    logger = MetricsLogger(run_dir_for(config), tensorboard=config.log.tensorboard)
    logger.write_config(config.to_dict())
    progress = Progress(config.env.total_steps, enabled=config.log.progress, description=config.algorithm)
    timer, start = Timer(), time.time()
    num_updates = config.env.total_steps // config.train.batch_size
    env_steps, episodes, recent_returns = 0, 0, []
    eval_history: list[tuple[int, float]] = []
    next_eval, steps_to_threshold, last_eval = config.eval.every_steps, None, [float("nan")]
    try:
        for update in range(1, num_updates + 1):
            lr = learner.set_lr_fraction(1.0 - (update - 1) / num_updates
                                         if config.train.lr_schedule == "linear" else 1.0)
            with timer("rollout"):
                batch = rollout.collect(policy, config.steps_per_env, bootstrap=bootstraps(config))
            env_steps += batch.num_steps
            episodes += len(batch.episode_returns)
            recent_returns = (recent_returns + batch.episode_returns)[-100:]
            with timer("advantage"):
                advantages, returns = compute_advantages(batch, config)
            with timer("update"):
                metrics = learner.update(flatten_batch(batch, advantages, returns))
            is_last = update == num_updates
            if env_steps >= next_eval or is_last:
                with timer("eval"):
                    last_eval = evaluate_policy(policy, config.env.id, episodes=config.eval.episodes,
                                                seed=config.seed + 10_000 + env_steps,
                                                deterministic=config.eval.deterministic,
                                                max_episode_steps=config.env.max_episode_steps)
                eval_mean = statistics.fmean(last_eval)
                eval_history.append((env_steps, eval_mean))
                logger.log(env_steps, {"eval/return_mean": eval_mean, "eval/return_std": statistics.pstdev(last_eval)})
                if return_threshold is not None and steps_to_threshold is None and eval_mean >= return_threshold:
                    steps_to_threshold = env_steps
                next_eval += config.eval.every_steps
            if update % config.log.log_every_updates == 0 or is_last:
                record = {f"train/{k}": v for k, v in metrics.items()}
                record.update(rollout_metrics(batch, advantages, returns, recent_returns))
                record.update({"train/learning_rate": lr, "train/update": update, "train/episodes": episodes,
                               "timing/steps_per_second": env_steps / (time.time() - start)})
                record.update(timer.pop())
                logger.log(env_steps, record)
            status = f"return {statistics.fmean(recent_returns):.1f}" if recent_returns else ""
            progress.update(env_steps, status)
    finally:
        progress.close()
        logger.close()
        rollout.close()
    return TrainResult(logger.run_dir, env_steps, episodes, time.time() - start, statistics.fmean(last_eval),
                       statistics.pstdev(last_eval), steps_to_threshold, eval_history,
                       statistics.fmean(recent_returns) if recent_returns else None)


def rollout_metrics(batch, advantages: torch.Tensor, returns: torch.Tensor, recent_returns: list[float]) -> dict:
    mask = batch.mask
    metrics = {
        "train/advantage_mean": float(masked_mean(advantages, mask)),
        "train/advantage_std": float(masked_var(advantages, mask).sqrt()),
        "train/explained_variance": float(explained_variance(batch.values, returns, mask)),
        "rollout/reward_mean": float(masked_mean(batch.rewards, mask)),
        "rollout/valid_fraction": float(mask.mean()),
    }
    if recent_returns:
        metrics["rollout/episode_return"] = statistics.fmean(recent_returns)
    if batch.episode_lengths:
        metrics["rollout/episode_length"] = statistics.fmean(batch.episode_lengths)
    return metrics
