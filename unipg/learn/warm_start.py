"""A cached supervised warm start of the embedded model on a task's demonstrations.

RL improves a policy that already sometimes succeeds; a randomly initialised model never does. So before
RL the embedded model is fine-tuned on the task's training demonstrations (completion-only loss), and the
result is saved under the cache folder, keyed by everything that determines it: the base model, the task
and its options, and the SFT settings. Later runs with the same key load it instantly. The warm start does
not depend on the run's seed, so runs with different seeds start from the same model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from unipg.config import Config
from unipg.policy.embedded import BUILDER_VERSION, cache_dir
from unipg.sample.tasks.base import Task

WARM_START_VERSION = 2
MARKER = "unipg-warm-start.json"


def demonstration_spec(spec):
    """The part of a tool spec that can change a demonstration: not a simulated latency, and not the ``faulty``
    wrapper, which only injects faults into calls (demonstrations call no tool)."""
    if not isinstance(spec, dict):
        return spec
    options = spec.get("options") or {}
    if spec.get("name") == "faulty" and isinstance(options.get("tool"), str):
        inner = {"name": options["tool"]}
        return demonstration_spec({**inner, "options": options["options"]} if options.get("options") else inner)
    return {key: value for key, value in spec.items() if key != "latency"}


def warm_start_key(config: Config) -> dict:
    tools = [demonstration_spec(spec) for spec in config.task.tools] if config.task.tools is not None else None
    return {"version": WARM_START_VERSION, "model": config.model.name, "embedded_builder": BUILDER_VERSION,
            "task": config.task.name, "options": config.task.options, "system_prompt": config.task.system_prompt,
            "tools": tools, "tool_prompt": config.agent.tool_prompt, "sft": config.sft.model_dump()}


def warm_start_folder(config: Config, root: Path | None = None) -> Path:
    key = json.dumps(warm_start_key(config), sort_keys=True, default=str)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return (root or cache_dir()) / "warm-start" / f"{config.task.name}-{digest}"


def resolve_warm_start(config: Config, task: Task, *, root: Path | None = None, log=print) -> Config:
    """The config with ``model.name`` pointing at the warm-started model (built now if not cached)."""
    if not config.model.warm_start:
        return config
    folder = warm_start_folder(config, root)
    if not (folder / MARKER).is_file():
        steps = config.sft.steps + sum(stage.steps for stage in config.sft.stages)
        log(f"warm start: fine-tuning {config.model.name} on {task.name} demonstrations "
            f"({steps} steps); cached in {folder}")
        build_warm_start(config, task, folder, log=log)
    model = config.model.model_copy(update={"name": str(folder), "warm_start": False})
    return config.model_copy(update={"model": model})


def build_warm_start(config: Config, task: Task, folder: Path, *, log=print) -> None:
    from unipg.learn.sft_job import fine_tune_on_demonstrations
    from unipg.policy.loading import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(config.model.name)
    model = load_causal_lm(config.model.name, dtype=config.model.dtype)
    metrics = fine_tune_on_demonstrations(model, tokenizer, task, config, seed=0, log_every=250,
                                          log=lambda text: log(f"warm start: {text}"))
    scratch = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    model.save_pretrained(scratch)
    tokenizer.save_pretrained(scratch)
    (scratch / MARKER).write_text(json.dumps({**warm_start_key(config), "final": metrics}, default=str))
    try:
        os.replace(scratch, folder)
    except OSError:  # another process finished the same warm start first; keep theirs
        shutil.rmtree(scratch, ignore_errors=True)
