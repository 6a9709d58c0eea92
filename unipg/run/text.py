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
from unipg.policy.chat import render_prompt
from unipg.policy.lm import LMPolicy
from unipg.policy.loading import policy_from_config
from unipg.run.classic import run_dir_for, seed_everything
from unipg.run.metrics import MetricsLogger, Progress, Timer
from unipg.run.text_learner import TextBatch, TextLearner
from unipg.sample.rewards import REWARDS, build_rewards
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


class PromptEncoder:
    """Renders (chat template) and tokenises task prompts once each; keeps the last max_length tokens."""

    def __init__(self, tokenizer, *, system_prompt: str | None, max_length: int):
        self.tokenizer, self.system_prompt, self.max_length = tokenizer, system_prompt, max_length
        self._cache: dict[str, list[int]] = {}

    def __call__(self, prompt: str) -> list[int]:
        if prompt not in self._cache:
            text = render_prompt(self.tokenizer, prompt, self.system_prompt)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            self._cache[prompt] = ids[-self.max_length:]
        return self._cache[prompt]


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


@torch.no_grad()
def evaluate_text(policy: LMPolicy, encode: PromptEncoder, examples: list[Example], config: Config, *,
                  seed: int) -> dict[str, float]:
    """Greedy pass@1 and sampled pass@k on held-out examples; correct = the final answer is equivalent."""
    is_correct = REWARDS.get("math")()
    sample, k = config.sample, config.eval.pass_k
    prompts = [example.prompt for example in examples]
    answers = columns_of(examples)
    chunk = max(config.train.micro_batch_size, 64)
    greedy, lengths = [], []
    for start in range(0, len(examples), chunk):
        generation = policy.sample([encode(p) for p in prompts[start:start + chunk]],
                                   max_new_tokens=sample.max_new_tokens, temperature=0.0, stop=sample.stop)
        greedy += generation.texts
        lengths += generation.completion_lengths.tolist()
    correct = is_correct(prompts, greedy, **answers)
    metrics = {"eval/pass@1": statistics.fmean(correct), "eval/response_length": statistics.fmean(lengths)}
    if k > 0:
        generator = torch.Generator().manual_seed(seed)
        solved = [False] * len(examples)
        for _ in range(k):
            texts = []
            for start in range(0, len(examples), chunk):
                texts += policy.sample([encode(p) for p in prompts[start:start + chunk]],
                                       max_new_tokens=sample.max_new_tokens, temperature=sample.temperature or 1.0,
                                       top_p=sample.top_p, top_k=sample.top_k, stop=sample.stop,
                                       generator=generator).texts
            solved = [s or bool(c) for s, c in zip(solved, is_correct(prompts, texts, **answers))]
        metrics[f"eval/pass@{k}"] = statistics.fmean(solved)
    return metrics


def rollout(policy: LMPolicy, encode: PromptEncoder, examples: list[Example], reward_fn, config: Config,
            generator: torch.Generator, timer: Timer) -> tuple[TextBatch, dict[str, float]]:
    """Sample ``samples_per_prompt`` completions of each example and score them."""
    sample, group = config.sample, config.sample.samples_per_prompt
    repeated = [example for example in examples for _ in range(group)]  # a prompt's samples are consecutive
    with timer("generate"):
        generation = policy.sample([encode(example.prompt) for example in repeated],
                                   max_new_tokens=sample.max_new_tokens, temperature=sample.temperature,
                                   top_p=sample.top_p, top_k=sample.top_k, stop=sample.stop, generator=generator)
    with timer("reward"):
        scored = reward_fn([example.prompt for example in repeated], generation.texts, **columns_of(repeated))
    lengths = generation.completion_lengths.float()
    scores = torch.tensor(scored.total)
    metrics = {"rollout/reward_mean": float(scores.mean()), "rollout/reward_std": float(scores.std()),
               "rollout/response_length": float(lengths.mean()), "rollout/response_length_max": float(lengths.max()),
               "rollout/truncated_fraction": statistics.fmean(r == "length" for r in generation.finish_reasons),
               "rollout/generated_tokens": float(lengths.sum())}
    for name, values in scored.per_function.items():
        applicable = [v for v in values if v is not None]
        if applicable:
            metrics[f"rollout/reward_{name}"] = statistics.fmean(applicable)
    solved = scores.reshape(-1, group).std(dim=1) == 0 if group > 1 else torch.zeros(1, dtype=torch.bool)
    metrics["rollout/uniform_group_fraction"] = float(solved.float().mean())  # groups with no learning signal
    return TextBatch.from_generation(generation, scored.total), metrics


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
    encode = PromptEncoder(policy.tokenizer, system_prompt=config.task.system_prompt or task.system_prompt,
                           max_length=config.sample.max_prompt_length)
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
        initial = evaluate_text(policy, encode, test, config, seed=config.seed + 10_000)
        history = [(0, initial)]
        logger.log(0, initial)
        for update in range(1, updates + 1):
            step_start = time.time()
            fraction = 1.0 - (update - 1) / updates if config.train.lr_schedule == "linear" else 1.0
            lr = learner.set_lr_fraction(fraction)
            batch, record = rollout(policy, encode, sampler.next(config.prompts_per_step), reward_fn, config,
                                    generator, timer)
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
                    evaluation = evaluate_text(policy, encode, test, config, seed=config.seed + 10_000 + update)
                history.append((update, evaluation))
                record.update(evaluation)
            if update % config.log.log_every_updates == 0 or update == updates or "eval/pass@1" in record:
                logger.log(update, record)
            progress.update(update, f"reward {record['rollout/reward_mean']:.3f} pass@1 {history[-1][1]['eval/pass@1']:.3f}")
        policy.save(run_dir / "policy")
    finally:
        progress.close()
        logger.close()
    return TextTrainResult(run_dir, updates, samples, time.time() - start, history[0][1], history[-1][1], history,
                           train_seconds)
