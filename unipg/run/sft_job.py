"""``unipg sft``: fine-tune a model on a task's demonstrations and save it for ``model.name=<folder>``."""

from __future__ import annotations

import time
from pathlib import Path

from unipg.config import Config
from unipg.policy.chat import render_prompt
from unipg.policy.loading import load_causal_lm, load_tokenizer
from unipg.run.sft import sft_accuracy, sft_train
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
    system_prompt = config.task.system_prompt or task.system_prompt

    def pairs(examples):
        return [(render_prompt(tokenizer, example.prompt, system_prompt), example.solution) for example in examples]

    train = task.train[: config.sft.examples] if config.sft.examples else task.train
    test = pairs(task.test[: config.eval.max_examples] if config.eval.max_examples else task.test)
    before = sft_accuracy(model, tokenizer, test, max_new_tokens=config.sample.max_new_tokens)
    metrics = sft_train(model, tokenizer, pairs(train), steps=config.sft.steps, batch_size=config.sft.batch_size,
                        learning_rate=config.sft.learning_rate, seed=config.seed,
                        on_log=lambda step, m: log(f"[sft] step {step}/{config.sft.steps} loss {m['loss']:.4f}"))
    after = sft_accuracy(model, tokenizer, test, max_new_tokens=config.sample.max_new_tokens)
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    return {"before": before, "after": after, "output": output, "metrics": metrics}
