"""``unipg sft``: fine-tune a model on a task's demonstrations and save it for ``model.name=<folder>``."""

from __future__ import annotations

import time
from pathlib import Path

from unipg.config import Config
from unipg.policy.loading import load_causal_lm, load_tokenizer
from unipg.run.episodes import demonstration_pairs, greedy_completion_rate
from unipg.run.sft import sft_train
from unipg.sample.tasks import make_task


def run_sft(config: Config, output: Path | None = None, *, log=print) -> dict:
    """Returns {"before", "after": held-out greedy accuracy, "output": folder, "metrics": final SFT metrics}."""
    task = make_task(config.task.name, **config.task.options)
    output = output or Path(config.log.output_dir) / f"sft-{task.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if output.exists() and any(output.iterdir()):
        raise ValueError(f"output folder '{output}' is not empty; choose another --output")
    tokenizer = load_tokenizer(config.model.name, trust_remote_code=config.model.trust_remote_code)
    model = load_causal_lm(config.model.name, dtype=config.model.dtype,
                           trust_remote_code=config.model.trust_remote_code)
    train = task.train[: config.sft.examples] if config.sft.examples else task.train
    test = task.test[: config.eval.max_examples] if config.eval.max_examples else task.test
    before = greedy_completion_rate(model, tokenizer, task, config, test)
    metrics = sft_train(model, tokenizer, demonstration_pairs(tokenizer, task, config, train),
                        steps=config.sft.steps, batch_size=config.sft.batch_size,
                        learning_rate=config.sft.learning_rate, seed=config.seed,
                        on_log=lambda step, m: log(f"[sft] step {step}/{config.sft.steps} loss {m['loss']:.4f}"))
    after = greedy_completion_rate(model, tokenizer, task, config, test)
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    return {"before": before, "after": after, "output": output, "metrics": metrics}
