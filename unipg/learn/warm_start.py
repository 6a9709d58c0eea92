"""Supervised fine-tuning jobs on a task's demonstrations: ``unipg sft`` (``run_sft``, saved for
``model.name=<folder>``) and the cached warm start of the embedded model before RL.

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
import time
from pathlib import Path

from unipg.config import Config
from unipg.config.devices import STARTUP_THREADS, cpu_threads, resolve_device
from unipg.config.lm import RoleConfig
from unipg.learn.evidence import evidence_check
from unipg.learn.sft import sft_train
from unipg.policy.embedded import BUILDER_VERSION, cache_dir
from unipg.policy.loading import load_causal_lm, load_tokenizer, role_model_name
from unipg.sample.episodes import build_task, demonstration_pairs, greedy_completion_rate, held_out, role_system_prompt
from unipg.tasks.base import Task, role_task

WARM_START_VERSION = 4  # 3: direct answers are sentences (tasks.base.direct_answer); 4: trained without the
# validation split, which the evidence stop reads instead of the test split
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


EVIDENCE_KEYS = (
    "evidence_stop",
    "evidence_every",
    "evidence_examples",
    "min_call_validity",
    "min_argument_accuracy",
    "min_answer_accuracy",
)


def warm_start_key(config: Config, role: str | None = None) -> dict:
    """What determines a warm start; the evidence-stop settings only when the stop is on, so that warm starts
    cached before it existed are still found. A warm start that stops on evidence also depends on what
    the evidence reads: the sampling length of its greedy turns. ``role``: the warm start of one role's own
    model (``agent.role_policy: separate``), on that role's demonstrations only."""
    tools = [demonstration_spec(spec) for spec in config.task.tools] if config.task.tools is not None else None
    sft = config.sft.model_dump()
    if config.sft.evidence_stop == "off":
        sft = {key: value for key, value in sft.items() if key not in EVIDENCE_KEYS}
    else:
        sft["evidence_max_new_tokens"] = config.sample.max_new_tokens
        sft["evidence_turns"] = "every trained turn after the first"  # was the last turn only
    key = {
        "version": WARM_START_VERSION,
        "model": role_model_name(config, role),
        "embedded_builder": BUILDER_VERSION,
        "task": config.task.name,
        "options": config.task.options,
        "system_prompt": config.task.system_prompt,
        "tools": tools,
        "tool_prompt": config.agent.tool_prompt,
        "sft": sft,
        **{
            key: getattr(config.model, key)
            for key in ("chat_template", "tool_parser")
            if getattr(config.model, key) is not None
        },
    }  # set only: caches built before them keep their key
    if config.model.dtype != "float32":  # trained in another precision; float32 keys stay as they were
        key["dtype"] = config.model.dtype
    if config.eval.validation_examples is not None:  # how much of train the validation split takes
        key["validation_examples"] = config.eval.validation_examples
    prompts = {role: settings.system_prompt for role, settings in config.agent.roles.items() if settings.system_prompt}
    if prompts:  # role prompts are rendered into multi-role demonstrations
        key["role_prompts"] = prompts
    if role is not None:
        key["role"] = role
    return key


def warm_start_folder(config: Config, root: Path | None = None, role: str | None = None) -> Path:
    key = json.dumps(warm_start_key(config, role), sort_keys=True, default=str)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    name = config.task.name if role is None else f"{config.task.name}-{role}"
    return (root or cache_dir()) / "warm-start" / f"{name}-{digest}"


def resolve_warm_start(config: Config, task: Task, *, root: Path | None = None, log=print) -> Config:
    """The config with ``model.name`` pointing at the warm-started model (built now if not cached). With
    ``agent.role_policy: separate`` each role's model is warm-started on its own role's demonstrations
    (``tasks.base.role_task``), and ``agent.roles.<role>.model`` points at it instead."""
    if not config.model.warm_start:
        return config
    model = config.model.model_copy(update={"warm_start": False})
    if config.agent.role_policy == "separate" and task.roles:
        roles = {
            role: config.agent.roles.get(role, RoleConfig()).model_copy(
                update={"model": str(warm_started(config, task, root, log, role))}
            )
            for role in task.roles
        }
        agent = config.agent.model_copy(update={"roles": {**config.agent.roles, **roles}})
        return config.model_copy(update={"model": model, "agent": agent})
    model = model.model_copy(update={"name": str(warm_started(config, task, root, log))})
    return config.model_copy(update={"model": model})


def warm_started(config: Config, task: Task, root: Path | None, log, role: str | None = None) -> Path:
    """The folder of the warm start of ``model.name`` (or of ``role``'s own model, with the role's own stages
    ``agent.roles.<role>.sft_stages`` when it has them), built now if not cached."""
    settings = config.agent.roles.get(role) if role is not None else None
    if settings is not None and settings.sft_stages is not None:
        config = config.model_copy(update={"sft": config.sft.model_copy(update={"stages": settings.sft_stages})})
    folder = warm_start_folder(config, root, role)
    if not (folder / MARKER).is_file():
        steps = config.sft.steps + sum(stage.steps for stage in config.sft.stages)
        threads, count = "", warm_start_threads(config)
        if resolve_device(config.device).type == "cpu":
            threads = (
                f" on {count} CPU threads; threads=1 while other work keeps the cores busy"
                if count > 1
                else " on 1 CPU thread"
            )
        whose = "" if role is None else f" of role {role}"
        log(
            f"warm start: fine-tuning {role_model_name(config, role)} on {task.name} demonstrations{whose} "
            f"({steps} steps{threads}); cached in {folder}"
        )
        build_warm_start(config, task, folder, log=log, role=role)
    return folder


def build_warm_start(config: Config, task: Task, folder: Path, *, log=print, role: str | None = None) -> None:
    tokenizer = load_tokenizer(config.model.name, chat_template=config.model.chat_template)
    model = load_causal_lm(
        role_model_name(config, role), dtype=config.model.dtype, device=resolve_device(config.device)
    )
    prefix = "warm start: " if role is None else f"warm start ({role}): "
    with cpu_threads(warm_start_threads(config)):
        metrics = fine_tune_on_demonstrations(
            model, tokenizer, task, config, seed=0, log_every=250, log=lambda text: log(f"{prefix}{text}"), role=role
        )
    scratch = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    model.save_pretrained(scratch)
    tokenizer.save_pretrained(scratch)
    (scratch / MARKER).write_text(json.dumps({**warm_start_key(config, role), "final": metrics}, default=str))
    try:
        os.replace(scratch, folder)
    except OSError:  # another process finished the same warm start first; keep theirs
        shutil.rmtree(scratch, ignore_errors=True)


def warm_start_threads(config: Config) -> int:
    """CPU threads for the warm start: ``threads`` when set, one for a deterministic run (a reduction split across
    threads may sum in another order), else torch's default. RL runs the embedded model on one thread, where its
    small per-token products are fastest; a fine-tuning step multiplies a whole batch of sequences at once, large
    enough for more cores to pay (``benchmarks/threads.py`` measures both counts). Threads that share cores with
    other work wait on each other instead, hence the advice to set ``threads=1`` on a busy machine."""
    if config.threads is not None:
        return config.threads
    return 1 if config.deterministic else STARTUP_THREADS


def fine_tune_on_demonstrations(
    model, tokenizer, task: Task, config: Config, *, seed: int, log_every: int, log=print, role: str | None = None
) -> dict:
    """Fine-tune on the task's demonstrations: each of ``sft.stages`` in order (the task rebuilt with the
    stage's options), then ``sft.steps`` on the task itself; returns the last stage's final metrics, with the
    ``evidence`` measured on the way (``unipg.learn.evidence``) when ``sft.evidence_stop`` is on. Every stage
    trains on its task's train split, without the validation split the evidence reads (``build_task``). ``role``:
    only that role's demonstrations of a multi-role task (``tasks.base.role_task``), for a model of its own."""

    def demonstrated(built: Task) -> Task:
        return built if role is None else role_task(built, role, role_system_prompt(config, built, role))

    sft, task = config.sft, demonstrated(build_task(config, task))
    stages = [
        (
            demonstrated(build_task(config, **stage.options)),
            stage.steps,
            stage.learning_rate or sft.learning_rate,
            stage.batch_size or sft.batch_size,
            f"stage {index + 1} ",
        )
        for index, stage in enumerate(sft.stages)
    ]
    stages.append((task, sft.steps, sft.learning_rate, sft.batch_size, "stage main " if stages else ""))
    metrics, evidence = {}, []
    for index, (stage_task, steps, learning_rate, batch_size, name) in enumerate(stages):
        train = stage_task.train[: sft.examples] if sft.examples else stage_task.train
        check = None
        if sft.evidence_stop == "all" or (sft.evidence_stop == "stages" and index < len(sft.stages)):
            check = evidence_check(model, tokenizer, stage_task, config, stage=name, log=log)
        metrics = sft_train(
            model,
            tokenizer,
            demonstration_pairs(tokenizer, stage_task, config, train),
            steps=steps,
            batch_size=batch_size,
            learning_rate=learning_rate,
            group_by_length=sft.group_by_length,
            seed=seed,
            log_every=log_every,
            on_log=lambda step, m, name=name, steps=steps: log(f"{name}step {step}/{steps} loss {m['loss']:.4f}"),
            stop_every=sft.evidence_every,
            should_stop=check,
        )
        evidence += check.history if check is not None else []
    return {**metrics, "evidence": evidence} if evidence else metrics


def run_sft(config: Config, output: Path | None = None, *, log=print) -> dict:
    """Returns {"before", "after": greedy accuracy on the test split (reported; the evidence stop reads the
    validation split), "output": folder, "metrics": final SFT metrics}."""
    task = build_task(config)
    output = output or Path(config.log.output_dir) / f"sft-{task.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if output.exists() and any(output.iterdir()):
        raise ValueError(f"output folder '{output}' is not empty; choose another --output")
    tokenizer = load_tokenizer(
        config.model.name, trust_remote_code=config.model.trust_remote_code, chat_template=config.model.chat_template
    )
    model = load_causal_lm(
        config.model.name,
        dtype=config.model.dtype,
        trust_remote_code=config.model.trust_remote_code,
        device=resolve_device(config.device),
    )
    test = held_out(task, config)
    before = greedy_completion_rate(model, tokenizer, task, config, test)
    metrics = fine_tune_on_demonstrations(
        model, tokenizer, task, config, seed=config.seed, log_every=50, log=lambda text: log(f"[sft] {text}")
    )
    after = greedy_completion_rate(model, tokenizer, task, config, test)
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    return {"before": before, "after": after, "output": output, "metrics": metrics}
