"""Configuration rules that involve more than one field, each phrased as how to fix the configuration.

Kept apart from ``unipg.config.schema`` (the schema) so that each file says one thing: what a field means there,
how fields must agree here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from unipg.config.devices import device_problem, resolve_device
from unipg.estimate import (
    ADVANTAGES,
    KL_ESTIMATORS,
    OFF_POLICY_WEIGHTS,
    POLICY_LOSSES,
    advantage_family,
    advantage_names,
    needs_critic,
    needs_greedy_baseline,
)
from unipg.registry import unknown_name_message

if TYPE_CHECKING:
    from unipg.config.schema import Config


def cross_field_problems(config: Config) -> list[str]:
    """Rules that involve more than one field, each phrased as how to fix it."""
    problems = []
    est = config.estimator
    problems += lm_problems(config) if config.is_lm else gym_problems(config)
    device = device_problem(config.device)  # refused rather than ignored: no silent CPU run
    if device is not None:
        problems.append(device)
    if config.backend == "ray" and config.task.agent:
        problems += ray_agent_problems(config)
    if config.data.offline is not None and not config.is_lm:
        problems.append("data.offline holds recorded text episodes; it applies to text tasks (set task.name) only")
    if config.backend == "ray" and not config.is_lm:
        problems.append(
            "backend 'ray' runs text tasks; train gymnasium environments with backend=inprocess "
            "(their vectorised environments already step in one process)"
        )
    if est.policy_loss != "trpo" and est.policy_loss not in POLICY_LOSSES:
        valid = POLICY_LOSSES.names() + ["trpo"]
        problems.append("estimator.policy_loss: " + unknown_name_message("policy loss", est.policy_loss, valid))
    if est.off_policy_weight not in OFF_POLICY_WEIGHTS:
        names = OFF_POLICY_WEIGHTS.names()
        problems.append(
            "estimator.off_policy_weight: " + unknown_name_message("off-policy weight", est.off_policy_weight, names)
        )
    if est.kl_estimator not in KL_ESTIMATORS:
        names = KL_ESTIMATORS.names()
        problems.append("estimator.kl_estimator: " + unknown_name_message("KL estimator", est.kl_estimator, names))
    if est.kl_control == "adaptive" and est.target_kl is None:
        problems.append(
            "estimator.kl_control is 'adaptive' but estimator.target_kl is not set; set target_kl (e.g. 0.02)"
        )
    if est.clip_range_high is not None and est.clip_range_high < est.clip_range:
        problems.append(
            f"estimator.clip_range_high ({est.clip_range_high}) is below clip_range ({est.clip_range}); "
            "clip-higher needs ε_high ≥ ε_low"
        )
    if Path(config.log.output_dir).is_file():
        problems.append(
            f"log.output_dir '{config.log.output_dir}' is a file; point it at a folder (each run gets "
            "a folder inside it)"
        )
    return problems


def decisions_on_test_split(config: Config) -> list[str]:
    """Warnings, each with its fix, for a decision of an lm run that would read the test split, which only reports
    (``unipg.tasks.base``): the best checkpoint chosen by an ``eval/…`` metric."""
    checkpoint = config.checkpoint
    if config.is_lm and checkpoint.keep_best and checkpoint.best_metric.startswith("eval/"):
        return [
            f"checkpoint.best_metric '{checkpoint.best_metric}' is measured on the test split, which should only "
            "report: choosing the best checkpoint by it lets the test split decide. Rank on the validation split "
            "instead, e.g. checkpoint.best_metric=val/pass@1"
        ]
    return []


def reads_episode_ends(advantage: str) -> bool:
    """Whether step estimator ``advantage`` reads episode ends (``dones``): a gymnasium segment holds several
    episodes per row, and a return must not flow from one into the one before."""
    return advantage_family(advantage) == "step" and "dones" in ADVANTAGES.entry(advantage).inputs


def ray_agent_problems(config: Config) -> list[str]:
    """An external agent on the Ray backend: each rollout worker serves its own endpoint (and the driver one for
    evaluation), and a worker is replaced when it holds its episodes past ``ray.episode_timeout``."""
    problems = []
    endpoint = config.endpoint
    if endpoint.port != 0:
        problems.append(
            f"endpoint.port ({endpoint.port}) is fixed, but with backend=ray every rollout worker runs its "
            "own endpoint (and the driver one for evaluation), which cannot share a port on one machine; "
            "leave endpoint.port at 0 (each takes a free port)"
        )
    longest = endpoint.agent_timeout * (endpoint.agent_retries + 1)
    if config.ray.episode_timeout < longest:
        problems.append(
            f"ray.episode_timeout ({config.ray.episode_timeout:g} s) is shorter than an external agent's "
            f"episode may take, endpoint.agent_timeout × (1 + endpoint.agent_retries) = {longest:g} s: "
            "its worker would be killed before the agent's own timeout counts the episode as failed; "
            "raise ray.episode_timeout or lower endpoint.agent_timeout"
        )
    return problems


def gym_problems(config: Config) -> list[str]:
    problems = []
    train, est = config.train, config.estimator
    if train.batch_transitions % train.mini_batch_transitions:
        problems.append(
            f"train.mini_batch_transitions ({train.mini_batch_transitions}) must divide "
            f"train.batch_transitions ({train.batch_transitions})"
        )
    if train.batch_transitions % config.env.num_envs:
        problems.append(
            f"env.num_envs ({config.env.num_envs}) must divide train.batch_transitions ({train.batch_transitions}): "
            "each environment takes batch_transitions / num_envs steps per update"
        )
    if est.advantage not in ADVANTAGES:
        problems.append(
            "estimator.advantage: " + unknown_name_message("advantage estimator", est.advantage, ADVANTAGES.names())
        )
    elif not reads_episode_ends(est.advantage):
        valid = ", ".join(name for name in advantage_names("step") if reads_episode_ends(name))
        if advantage_family(est.advantage) != "step":
            problems.append(
                f"estimator.advantage '{est.advantage}' works on groups of sampled completions (text "
                f"tasks); for gymnasium environments use one of: {valid}"
            )
        else:
            problems.append(
                f"estimator.advantage '{est.advantage}' does not read episode ends (dones), so its returns "
                f"would flow across the episodes of a gymnasium segment; use one of: {valid}"
            )
    if train.batch_transitions > config.env.total_steps:
        problems.append(
            f"train.batch_transitions ({train.batch_transitions}) exceeds env.total_steps ({config.env.total_steps}); "
            "no update would run — raise total_steps or lower batch_transitions"
        )
    return problems


def learner_rank_problems(config: Config) -> list[str]:
    """Learner ranks this machine could never place: more CUDA ranks than GPUs (a GPU each), or, on a local
    Ray instance (``ray.address`` unset), more CPUs than it has."""
    train, ray = config.train, config.ray
    if config.backend == "ray" and ray.address is not None:
        return []  # a cluster may grow; the run warns and waits up to ray.start_timeout
    problems = []
    cpus = train.learner_processes * ray.learner_num_cpus
    if config.backend == "ray" and ray.num_cpus is not None and cpus > ray.num_cpus:
        problems.append(
            f"train.learner_processes ({train.learner_processes}) × ray.learner_num_cpus "
            f"({ray.learner_num_cpus:g}) = {cpus:g} CPUs, more than the local Ray instance has "
            f"(ray.num_cpus={ray.num_cpus}); lower ray.learner_num_cpus (e.g. "
            f"{ray.num_cpus / (train.learner_processes + ray.rollout_workers):g}) or raise ray.num_cpus"
        )
    if device_problem(config.device) is None and resolve_device(config.device).type == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if train.learner_processes > gpus:
            problems.append(
                f"train.learner_processes ({train.learner_processes}) ranks on device "
                f"'{config.device}' take a GPU each; this machine has {gpus}: lower "
                "train.learner_processes" + (" or join a cluster with ray.address" if config.backend == "ray" else "")
            )
    return problems


def lm_batch_problems(config: Config) -> list[str]:
    """How a language-model run's batch divides: into mini- and micro-batches, prompt groups, learner ranks, and
    the replay buffer that must hold it."""
    problems = []
    train, sample = config.train, config.sample
    if train.batch_size % train.mini_batch_size:
        problems.append(
            f"train.mini_batch_size ({train.mini_batch_size}) must divide train.batch_size ({train.batch_size})"
        )
    if train.batch_size % sample.samples_per_prompt:
        problems.append(
            f"sample.samples_per_prompt ({sample.samples_per_prompt}) must divide train.batch_size "
            f"({train.batch_size}): every prompt contributes a full group of completions"
        )
    if train.learner_processes > 1:
        problems += learner_rank_problems(config)
    if train.mini_batch_size % train.micro_batch_size and train.micro_batch_size < train.mini_batch_size:
        problems.append(
            f"train.micro_batch_size ({train.micro_batch_size}) must divide train.mini_batch_size "
            f"({train.mini_batch_size}): gradients are accumulated over whole micro-batches"
        )
    per_step = config.prompts_per_step * sample.samples_per_prompt  # trajectories one learner step trains on
    if sample.replay_buffer_size < per_step:
        problems.append(
            f"sample.replay_buffer_size ({sample.replay_buffer_size}) cannot hold one learner step's batch of "
            f"{per_step} trajectories; set it to at least {(config.runtime.max_staleness + 1) * per_step} "
            "((runtime.max_staleness + 1) batches, so that nothing admitted is evicted)"
        )
    if config.runtime.partial_rollouts and sample.engine != "vllm":
        problems.append(
            "runtime.partial_rollouts interrupts the vllm engine's turns in flight when new weights load; the "
            f"'{sample.engine}' engine loads weights between generate calls, so its episodes already continue under "
            "new weights at their next turn: set sample.engine=vllm, or runtime.partial_rollouts=false"
        )
    if config.runtime.partial_rollouts and config.runtime.max_staleness == 0:
        problems.append(
            "runtime.partial_rollouts continues turns across weight loads, and with runtime.max_staleness=0 no "
            "weights load while episodes run: set runtime.max_staleness > 0, or runtime.partial_rollouts=false"
        )
    return problems


def reference_sync_problems(config: Config) -> list[str]:
    """``estimator.ref_sync_steps`` moves the reference model: the run must hold a copy of its own to move."""
    est, model = config.estimator, config.model
    if est.ref_sync_steps is None:
        return []
    needs_reference = est.kl_coef > 0 or est.kl_control == "adaptive"  # as unipg.policy.loading decides
    if model.reference == "none" or (model.reference == "auto" and not needs_reference):
        return [
            "estimator.ref_sync_steps moves the reference model, which this run does not hold (model.reference "
            "'none', or 'auto' without a KL penalty); set estimator.kl_coef > 0 or model.reference=copy, or unset "
            "estimator.ref_sync_steps"
        ]
    if model.lora_rank > 0:
        return [
            "estimator.ref_sync_steps cannot move a LoRA run's reference: it is the base model with the adapter "
            "switched off, the same weights the policy trains its adapter on; train without LoRA "
            "(model.lora_rank=0) or unset estimator.ref_sync_steps"
        ]
    if config.train.learner_processes > 1:
        return [
            "estimator.ref_sync_steps is not supported with a sharded learner (train.learner_processes > 1); "
            "set train.learner_processes=1 or unset estimator.ref_sync_steps"
        ]
    return []


def greedy_baseline_problems(config: Config) -> list[str]:
    """An estimator that compares each completion with the greedy episode of its prompt (remax), which the run
    generates for the prompts it samples: refused where that baseline is missing or means nothing."""
    advantage, sample = config.estimator.advantage, config.sample
    problems = []
    if config.data.offline is not None:
        problems.append(
            f"estimator.advantage '{advantage}' compares each completion with a greedy episode of its prompt under "
            "the policy being trained, which the run generates for the prompts it samples, not for the recorded "
            "episodes of data.offline; unset data.offline or pick another estimator (e.g. rloo, grpo)"
        )
    if sample.dynamic_sampling:
        problems.append(
            f"sample.dynamic_sampling drops groups whose completions all scored alike, but estimator.advantage "
            f"'{advantage}' compares each completion with the greedy episode of its prompt, so such a group still "
            "has a gradient; set sample.dynamic_sampling=false"
        )
    if sample.temperature == 0:
        problems.append(
            f"sample.temperature is 0: every completion is the greedy one, so estimator.advantage '{advantage}' "
            "(the reward minus that of the greedy completion) is 0 for all of them; sample at a temperature > 0 "
            "(e.g. 1.0)"
        )
    return problems


def lm_problems(config: Config) -> list[str]:
    problems = lm_batch_problems(config) + reference_sync_problems(config)
    est, sample, model = config.estimator, config.sample, config.model
    if est.advantage not in ADVANTAGES:
        problems.append(
            "estimator.advantage: " + unknown_name_message("advantage estimator", est.advantage, ADVANTAGES.names())
        )
    elif "group_size" in ADVANTAGES.entry(est.advantage).inputs and sample.samples_per_prompt < 2:
        problems.append(
            f"estimator.advantage '{est.advantage}' compares completions of the same prompt; set "
            "sample.samples_per_prompt to at least 2 (e.g. 8)"
        )
    known = est.advantage in ADVANTAGES
    if known and needs_greedy_baseline(est.advantage):
        problems += greedy_baseline_problems(config)
    elif sample.dynamic_sampling and known and advantage_family(est.advantage) != "group":
        problems.append(
            f"sample.dynamic_sampling drops groups whose group-relative advantages are zero; estimator.advantage "
            f"'{est.advantage}' does not compare a prompt's completions, so no group is without a gradient: use "
            f"one of {', '.join(advantage_names('group'))}, or set sample.dynamic_sampling=false"
        )
    if known and needs_critic(est.advantage) and not (model.value_head or model.critic):
        problems.append(
            f"estimator.advantage '{est.advantage}' needs a critic; set model.value_head=true or model.critic=<model>"
        )
    if model.warm_start and not model.name.startswith("embedded"):
        problems.append(
            "model.warm_start builds a cached warm start of the embedded model only; for another "
            "model run `unipg sft` and point model.name at its output"
        )
    if est.policy_loss == "trpo":
        problems.append(
            "estimator.policy_loss 'trpo' is implemented for MLP policies only; use ppo for language models"
        )
    problems += role_policy_problems(config)
    if config.data.offline is not None and config.prompts_per_step < 2:
        problems.append(
            "data.offline mixes recorded prompt groups into each batch and keeps at least one fresh; "
            f"the batch has {config.prompts_per_step} prompt group: raise train.batch_size to at least "
            f"{2 * sample.samples_per_prompt} (2 × sample.samples_per_prompt)"
        )
    return problems


def role_policy_problems(config: Config) -> list[str]:
    """What ``agent.role_policy`` (with ``adapters`` or ``separate``) does not run with, and a role's own model or
    warm-start stages (``agent.roles.<role>.model``, ``.sft_stages``) named where no role has a model of its own."""
    if config.agent.role_policy == "separate":
        return separate_role_problems(config)
    problems = role_adapter_problems(config) if config.agent.role_policy == "adapters" else []
    return problems + [
        f"agent.roles.{role}.{setting} is read with agent.role_policy=separate only; set agent.role_policy=separate "
        f"(a model per role), or remove agent.roles.{role}.{setting}"
        for role, settings in config.agent.roles.items()
        for setting in ("model", "sft_stages")
        if getattr(settings, setting) is not None
    ]


def role_adapter_problems(config: Config) -> list[str]:
    """``agent.role_policy: adapters`` (a LoRA adapter per role): what it needs, and what this version does not run
    it with."""
    unsupported = {  # what is set → what to set instead
        "model.lora_rank=0 (no adapter)": (config.model.lora_rank == 0, "model.lora_rank (e.g. 8)"),
        f"train.learner_processes={config.train.learner_processes}": (
            config.train.learner_processes > 1,
            "train.learner_processes=1",
        ),
        "a value head or critic model (shared by the roles)": (
            config.model.value_head or config.model.critic is not None,
            "model.value_head=false and no model.critic (e.g. algorithm=grpo)",
        ),
    }
    return role_policy_refusals("adapters (a LoRA adapter per role)", unsupported)


def separate_role_problems(config: Config) -> list[str]:
    """``agent.role_policy: separate`` (a model and a learner per role): what this version does not run it with."""
    unsupported = {  # what is set → what to set instead
        f"train.learner_processes={config.train.learner_processes}": (
            config.train.learner_processes > 1,
            "train.learner_processes=1",
        ),
        "a value head or critic model": (
            config.model.value_head or config.model.critic is not None,
            "model.value_head=false and no model.critic (e.g. algorithm=grpo)",
        ),
        f"model.lora_rank={config.model.lora_rank} (LoRA on each role's model)": (
            config.model.lora_rank > 0,
            "model.lora_rank=0, or agent.role_policy=adapters for one base model with an adapter per role",
        ),
        "data.offline (recorded episodes of one policy)": (config.data.offline is not None, "no data.offline"),
    }
    return role_policy_refusals("separate (a model per role)", unsupported) + [
        f"model.warm_start warm-starts each role's model with agent.role_policy=separate, and builds a cached "
        f"warm start of the embedded model only; agent.roles.{role}.model is '{settings.model}': run `unipg sft` "
        f"for that model and point agent.roles.{role}.model at its output, with model.warm_start=false"
        for role, settings in config.agent.roles.items()
        if config.model.warm_start and settings.model is not None and not settings.model.startswith("embedded")
    ]


def role_policy_refusals(role_policy: str, unsupported: dict[str, tuple[bool, str]]) -> list[str]:
    """One problem per setting of ``unsupported`` (what is set → whether it is, what to set instead) that is in use
    with ``agent.role_policy=<role_policy>``."""
    return [
        f"agent.role_policy={role_policy} does not run with {setting} in this version; set {instead}, or "
        "agent.role_policy=shared (one model, a system prompt per role)"
        for setting, (used, instead) in unsupported.items()
        if used
    ]
