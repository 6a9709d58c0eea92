"""Synchronous training of language-model policies on single-turn text tasks.

One learner update reads top to bottom: draw ``batch_size / samples_per_prompt`` prompts, sample
``samples_per_prompt`` completions of each with the current weights (recording their behaviour log-probs),
score them with the reward functions, compute reference log-probs and values, estimate advantages, take
``num_epochs`` passes of mini-batch steps. Held-out greedy pass@1 and sampled pass@k are measured before
training, every ``eval.every_updates`` updates and at the end.

This is the staleness-0 case of the unified objective: every sample's behaviour policy μ is the policy
that the update starts from, so ρ = 1 at the first mini-batch step.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from unipg.config import Config
from unipg.policy.loading import policy_from_config
from unipg.run.classic import run_dir_for, seed_everything
from unipg.run.episodes import EpisodeRunner, PromptEncoder, episode_metrics, reward_term_metrics  # noqa: F401
from unipg.run.metrics import MetricsLogger, Progress, Timer
from unipg.run.text_learner import TextBatch, TextLearner
from unipg.sample.rewards import build_rewards
from unipg.sample.tasks import Example, Task, make_task


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


def rollout(runner: EpisodeRunner, examples: list[Example], config: Config, generator: torch.Generator,
            policy_version: int = 0) -> tuple[TextBatch, dict[str, float]]:
    """Run ``samples_per_prompt`` episodes of each example (consecutive, a GRPO group) and batch them."""
    group = config.sample.samples_per_prompt
    repeated = [example for example in examples for _ in range(group)]
    start = time.perf_counter()
    trajectories = runner.run(repeated, params=runner.sampling(), generator=generator, policy_version=policy_version)
    elapsed = time.perf_counter() - start
    batch = TextBatch.from_trajectories(trajectories, runner.policy.pad_id)
    scores = batch.scores
    lengths = batch.completion_mask.sum(1)
    metrics = {"rollout/reward_mean": float(scores.mean()), "rollout/reward_std": float(scores.std()),
               "rollout/response_length_max": float(lengths.max()), "rollout/generated_tokens": float(lengths.sum()),
               "rollout/generate_batch_mean": statistics.fmean(runner.last_batch_sizes),
               # generation and environment steps interleave: env is the rollout time not spent generating
               "timing/generate": runner.last_generate_seconds,
               "timing/env": max(elapsed - runner.last_generate_seconds, 0.0)}
    metrics.update(episode_metrics(trajectories, "rollout", group_size=group,
                                   tools=runner.service is not None))
    metrics.update(reward_term_metrics(trajectories, "rollout"))
    metrics.update(runner.pop_service_metrics("rollout"))
    solved = scores.reshape(-1, group).std(dim=1) == 0 if group > 1 else torch.zeros(1, dtype=torch.bool)
    metrics["rollout/uniform_group_fraction"] = float(solved.float().mean())  # groups with no learning signal
    return batch, metrics


def set_threads(config: Config) -> None:
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    elif config.model.name.startswith("embedded"):
        torch.set_num_threads(1)


def train_text(config: Config, *, task: Task | None = None) -> TextTrainResult:
    """Train ``config.model.name`` on ``config.task.name`` with the configured estimator."""
    from unipg.run.warm_start import resolve_warm_start

    seed_everything(config.seed, config.deterministic)
    set_threads(config)
    task = task or make_task(config.task.name, **config.task.options)
    config = resolve_warm_start(config, task)
    reward_fn = build_rewards(config.task.rewards or task.rewards)
    policy = policy_from_config(config)
    runner = EpisodeRunner(policy, task, config, reward_fn)
    test = task.test[: config.eval.max_examples] if config.eval.max_examples else task.test
    learner = TextLearner(policy, config)
    sampler, generator = PromptSampler(task.train, config.seed), torch.Generator().manual_seed(config.seed)
    run_dir = run_dir_for(config)
    logger = MetricsLogger(run_dir, tensorboard=config.log.tensorboard)
    logger.write_config(config.to_dict())
    updates = config.train.updates
    progress = Progress(updates, enabled=config.log.progress, description=f"{config.algorithm} {task.name}")
    timer, start, train_seconds, samples = Timer(), time.time(), 0.0, 0
    try:
        initial = evaluate_text(runner, test, config, seed=config.seed + 10_000)
        history = [(0, initial)]
        logger.log(0, initial)
        for update in range(1, updates + 1):
            step_start = time.time()
            fraction = 1.0 - (update - 1) / updates if config.train.lr_schedule == "linear" else 1.0
            lr = learner.set_lr_fraction(fraction)
            batch, record = rollout(runner, sampler.next(config.prompts_per_step), config, generator,
                                    policy_version=update - 1)
            with timer("logprob"):
                record.update({f"train/{k}": v for k, v in learner.prepare(batch).items()})
            with timer("update"):
                record.update({f"train/{k}": v for k, v in learner.update(batch).items()})
            step_seconds = time.time() - step_start
            train_seconds += step_seconds
            samples += len(batch.scores)
            record.update(timer.pop())
            record.update({"train/learning_rate": lr, "train/samples": samples,
                           "timing/step": step_seconds, "timing/samples_per_second": len(batch.scores) / step_seconds,
                           "timing/tokens_per_second": record["rollout/generated_tokens"] / step_seconds})
            if update % config.eval.every_updates == 0 or update == updates:
                with timer("eval"):
                    evaluation = evaluate_text(runner, test, config, seed=config.seed + 10_000 + update)
                history.append((update, evaluation))
                record.update(evaluation)
            if update % config.log.log_every_updates == 0 or update == updates or "eval/pass@1" in record:
                logger.log(update, record)
            progress.update(update, f"reward {record['rollout/reward_mean']:.3f} pass@1 {history[-1][1]['eval/pass@1']:.3f}")
        policy.save(run_dir / "policy")
    finally:
        runner.close()
        progress.close()
        logger.close()
    return TextTrainResult(run_dir, updates, samples, time.time() - start, history[0][1], history[-1][1], history,
                           train_seconds)
