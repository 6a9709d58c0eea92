"""``unipg eval``: a model's held-out metrics on a text task, with the evaluation that training runs.

Greedy episodes on the task's test split give pass@1 (the task completion rate), turns, tool calls, tool
success and the tool service's counters; with ``eval.pass_k`` > 0, k sampled episodes per example give pass@k.
These are the ``eval/…`` metrics, which report and decide nothing. During training the same greedy metrics on the
validation split are the ``val/…`` ones, which decisions read (``checkpoint.best_metric``).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from unipg.config import Config
from unipg.config.run_folder import read_run_folder
from unipg.observe.rollout_metrics import episode_metrics
from unipg.sample.agent import Trajectory
from unipg.sample.episodes import EpisodeRunner
from unipg.sample.validate import check_sample_options
from unipg.tasks.base import Example

EVALUATION_SECTIONS = ("task", "model", "agent", "sample", "eval", "sft")
"""The sections of a configuration that evaluation reads (``sft`` for a ``model.warm_start=true`` override).
Secrets a run saved redacted in the others (a W&B key in ``ray.runtime_env``) need not be passed again to
evaluate it."""


def notify_stderr(message: str) -> None:
    print(f"notice: {message}", file=sys.stderr)


def run_config(
    run_dir: Path, overrides: list[str], notify: Callable[[str], None] = notify_stderr, *, trust_code: bool = False
) -> Config:
    """The configuration of a finished run, pointed at the policy the run saved; the code the folder names is not
    run unless the user names it again or passes ``trust_code`` (``unipg.config.run_folder``)."""
    if not (run_dir / "config.yaml").is_file() or not (run_dir / "policy").is_dir():
        raise ValueError(
            f"'{run_dir}' is not a finished lm run (it needs config.yaml and policy/); pass the "
            "folder `unipg train` created, or evaluate a model with model.name=..."
        )
    unread = tuple(name for name in Config.model_fields if name not in EVALUATION_SECTIONS)
    return read_run_folder(
        run_dir,
        [*saved_policy_overrides(run_dir / "policy"), "model.warm_start=false", *overrides],
        unread=unread,
        trust_code=trust_code,
        notify=notify,
        check=check_sample_options,
    )


def saved_policy_overrides(policy_dir: Path) -> list[str]:
    """The settings that point a run's configuration at the policy it saved: ``model.name`` at ``policy/``, or, with
    a model per role (``agent.role_policy: separate``, saved as ``policy/<role>/``), each role's
    ``agent.roles.<role>.model`` at its own folder (and ``model.name`` at the first, for the shared tokenizer)."""
    if (policy_dir / "config.json").is_file():
        return [f"model.name={policy_dir}"]
    roles = sorted(folder.name for folder in policy_dir.iterdir() if (folder / "config.json").is_file())
    if not roles:
        return [f"model.name={policy_dir}"]  # not a saved model: loading it says what is missing
    return [f"model.name={policy_dir / roles[0]}", *(f"agent.roles.{role}.model={policy_dir / role}" for role in roles)]


def evaluate_episodes(
    runner: EpisodeRunner, examples: list[Example], *, pass_k: int, seed: int, prefix: str = "eval"
) -> tuple[dict[str, float], list[Trajectory]]:
    """Greedy episodes on held-out examples — pass@1 is the task completion rate (the final answer equals the
    reference), with turns and tool use — and, from ``pass_k`` sampled episodes per example (none if 0,
    ``eval.pass_k``), pass@k (solved by any of them) and the sampled completion rate (the share of them solved:
    the policy as it samples, which RL trains, where greedy decoding shows only its mode). The metrics, named
    ``<prefix>/…`` (``eval`` for the test split, ``val`` for the validation split), and the greedy episodes in the
    order of ``examples``."""
    greedy = runner.run(examples, params=runner.sampling(greedy=True), generator=None).trajectories
    metrics = {f"{prefix}/pass@1": statistics.fmean(t.correct for t in greedy)}
    metrics.update(
        {
            key: value
            for key, value in episode_metrics(greedy, prefix, tools=runner.service is not None).items()
            if key != f"{prefix}/completion_rate"
        }
    )
    metrics.update(runner.pop_service_metrics(prefix))
    k = pass_k
    if k > 0:
        generator = torch.Generator().manual_seed(seed)
        sampled = runner.run([example for example in examples for _ in range(k)], generator=generator).trajectories
        solved = [any(t.correct for t in sampled[i * k : (i + 1) * k]) for i in range(len(examples))]
        metrics[f"{prefix}/pass@{k}"] = statistics.fmean(solved)
        metrics[f"{prefix}/sampled_completion"] = statistics.fmean(t.correct for t in sampled)
        runner.pop_service_metrics(prefix)
    return metrics, greedy


def evaluate_lm(runner: EpisodeRunner, examples: list[Example], *, pass_k: int, seed: int) -> dict[str, float]:
    """The metrics of ``evaluate_episodes``."""
    return evaluate_episodes(runner, examples, pass_k=pass_k, seed=seed)[0]


def evaluate_model(config: Config) -> dict[str, float]:
    """Held-out metrics of ``config.model.name`` on ``config.task.name`` (``eval.max_examples`` of its test split,
    ``eval/…``)."""
    return evaluate_model_episodes(config, show=0)[0]


def evaluate_model_episodes(config: Config, *, show: int) -> tuple[dict[str, float], list[dict]]:
    """``evaluate_model``, and the transcripts (``unipg.sample.transcripts``) of its first ``show`` greedy
    episodes."""
    from unipg.config.devices import resolve_device
    from unipg.runtime.setup import seed_everything, set_threads
    from unipg.sample.episodes import EpisodeRunner, build_task, held_out
    from unipg.sample.transcripts import transcript
    from unipg.tasks.rewards.rules import build_rewards, reward_defaults

    if not config.is_lm:
        raise ValueError(
            "unipg eval evaluates language models on text tasks: set task.name (gymnasium runs are "
            "evaluated during training, see eval.episodes)"
        )
    seed_everything(config.seed, config.deterministic)
    set_threads(config)
    task = build_task(config)  # with the validation split a warm start of the run reads, carved as the run carves it
    if config.model.warm_start:
        from unipg.learn.warm_start import resolve_warm_start

        config = resolve_warm_start(config, task)
    device = resolve_device(config.device)
    options = dict(
        dtype=config.model.dtype,
        trust_remote_code=config.model.trust_remote_code,
        device=device,
        chat_template=config.model.chat_template,
    )
    policy = evaluated_policy(config, list(task.roles), options)
    rewards = build_rewards(config.task.rewards or task.rewards, defaults=reward_defaults(config))
    runner = EpisodeRunner(policy, task, config, rewards)
    test = held_out(task, config)
    try:
        metrics, greedy = evaluate_episodes(runner, test, pass_k=config.eval.pass_k, seed=config.seed + 10_000)
        return metrics, [transcript(trajectory) for trajectory in greedy[:show]]
    finally:
        runner.close()


def evaluated_policy(config: Config, roles: list[str], options: dict):
    """The policy ``config`` names, as its run trained it: one model; a model per role (``agent.role_policy:
    separate``); or, for a run with an adapter per role (``agent.role_policy: adapters``, saved as
    ``policy/<role>/adapter_model.safetensors`` beside no whole model), the base model the adapters were trained on
    with each role's adapter loaded under its role's name."""
    from unipg.policy.loading import load_lm_policy, role_model_name
    from unipg.policy.role_policies import RolePolicies

    if config.agent.role_policy == "separate":
        return RolePolicies({role: load_lm_policy(role_model_name(config, role), **options) for role in roles})
    folder = Path(config.model.name)
    saved = {role: folder / role for role in roles if (folder / role / "adapter_config.json").is_file()}
    if config.agent.role_policy != "adapters" or not saved:
        return load_lm_policy(config.model.name, **options)
    from safetensors.torch import load_file

    from unipg.policy.adapters import load_adapter_tensors

    base = json.loads((next(iter(saved.values())) / "adapter_config.json").read_text())["base_model_name_or_path"]
    model = config.model
    policy = load_lm_policy(
        base,
        **options,
        lora_rank=model.lora_rank,
        lora_alpha=model.lora_alpha,
        lora_target_modules=model.lora_target_modules,
        roles=roles,
    )
    for role, adapter in saved.items():
        load_adapter_tensors(policy.model, load_file(adapter / "adapter_model.safetensors"), name=role)
    return policy
