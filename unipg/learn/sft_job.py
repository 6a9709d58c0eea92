"""``unipg sft``: fine-tune a model on a task's demonstrations and save it for ``model.name=<folder>``."""

from __future__ import annotations

import time
from pathlib import Path

from unipg.config import Config
from unipg.learn.sft import sft_train
from unipg.policy.loading import load_causal_lm, load_tokenizer
from unipg.sample.episodes import demonstration_pairs, greedy_completion_rate, held_out
from unipg.sample.tasks.base import Task, make_task


def fine_tune_on_demonstrations(model, tokenizer, task: Task, config: Config, *, seed: int, log_every: int,
                                log=print) -> dict:
    """Fine-tune on the task's demonstrations: each of ``sft.stages`` in order (the task rebuilt with the
    stage's options), then ``sft.steps`` on the task itself; returns the last stage's final metrics."""
    sft = config.sft
    stages = [(make_task(config.task.name, **{**config.task.options, **stage.options}), stage.steps,
               stage.learning_rate or sft.learning_rate, stage.batch_size or sft.batch_size, f"stage {index + 1} ")
              for index, stage in enumerate(sft.stages)]
    stages.append((task, sft.steps, sft.learning_rate, sft.batch_size, "stage main " if stages else ""))
    metrics = {}
    for stage_task, steps, learning_rate, batch_size, name in stages:
        train = stage_task.train[: sft.examples] if sft.examples else stage_task.train
        metrics = sft_train(model, tokenizer, demonstration_pairs(tokenizer, stage_task, config, train),
                            steps=steps, batch_size=batch_size, learning_rate=learning_rate,
                            group_by_length=sft.group_by_length, seed=seed, log_every=log_every,
                            on_log=lambda step, m, name=name, steps=steps:
                            log(f"{name}step {step}/{steps} loss {m['loss']:.4f}"))
    return metrics


def run_sft(config: Config, output: Path | None = None, *, log=print) -> dict:
    """Returns {"before", "after": held-out greedy accuracy, "output": folder, "metrics": final SFT metrics}."""
    task = make_task(config.task.name, **config.task.options)
    output = output or Path(config.log.output_dir) / f"sft-{task.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if output.exists() and any(output.iterdir()):
        raise ValueError(f"output folder '{output}' is not empty; choose another --output")
    tokenizer = load_tokenizer(config.model.name, trust_remote_code=config.model.trust_remote_code)
    model = load_causal_lm(config.model.name, dtype=config.model.dtype,
                           trust_remote_code=config.model.trust_remote_code)
    test = held_out(task, config)
    before = greedy_completion_rate(model, tokenizer, task, config, test)
    metrics = fine_tune_on_demonstrations(model, tokenizer, task, config, seed=config.seed, log_every=50,
                                          log=lambda text: log(f"[sft] {text}"))
    after = greedy_completion_rate(model, tokenizer, task, config, test)
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    return {"before": before, "after": after, "output": output, "metrics": metrics}
