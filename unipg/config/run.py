"""Sections about how a run executes and records itself: evaluation, the rollout/learner runtime, Ray placement,
and logging."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from unipg.config.section import Section, read_in


class EvalConfig(Section):
    """Periodic evaluation on fresh environments."""

    every_steps: int = Field(10_000, ge=1, json_schema_extra=read_in("gym"))
    """evaluate every this many environment steps (and once at the end)."""
    episodes: int = Field(20, ge=1, json_schema_extra=read_in("gym"))
    """evaluation episodes."""
    deterministic: bool = Field(True, json_schema_extra=read_in("gym"))
    """act greedily (mode of the policy) during evaluation."""
    every_updates: int = Field(10, ge=1, json_schema_extra=read_in("lm"))
    """lm runs: evaluate every this many learner updates (and before and after): on the test split, reported as
    eval/… and read by no decision, and (not before training) greedily on the validation split as val/…, which
    checkpoint.best_metric ranks."""
    pass_k: int = Field(4, ge=0, json_schema_extra=read_in("lm"))
    """lm runs: also report sampled pass@k on the test split with this k (0 = greedy pass@1 only)."""
    max_examples: int | None = Field(None, ge=1, json_schema_extra=read_in("lm"))
    """lm runs: evaluate on the first this many test examples (None = all)."""
    validation_examples: int | None = Field(None, ge=0, json_schema_extra=read_in("lm"))
    """lm runs: size of the validation split that decisions during training read (val/… for checkpoint.keep_best,
    sft.evidence_stop): a task without one of its own gives up this many train examples, chosen with its data_seed,
    and one with its own keeps its first this many. None = a tenth of train, at most 128 (at least 1 when train has
    two examples or more); 0 = none."""
    transcripts: int = Field(4, ge=0)
    """lm runs: at each evaluation, write the transcripts of the first this many greedy episodes on the test split
    to <run>/transcripts/eval_<update>.jsonl and to TensorBoard as text (0 = none)."""


class RuntimeConfig(Section):
    """How rollout and learner share the work (``unipg.runtime.driver``, ``unipg.runtime.replay``)."""

    max_staleness: int = Field(0, ge=0)
    """η: the most learner versions a trajectory may lag behind the learner that trains on it, enforced when
    episodes are started (AReaL's max_head_offpolicyness); 0 is synchronous training."""
    schedule: Literal["auto", "sequential", "concurrent"] = "auto"
    """sequential: rollout fills the buffer between learner steps (reproducible; exactly η versions old data);
    concurrent: rollout runs in a background thread on its own copy of the weights; auto: sequential when
    max_staleness is 0 or ``deterministic`` is set, else concurrent."""
    sampling: Literal["fifo", "fresh", "weighted"] = "fifo"
    """Which buffered groups a learner step takes: oldest first, newest first, or at random with probability
    ∝ freshness_decay ** age."""
    freshness_decay: float = Field(0.5, gt=0.0, le=1.0)
    """Per-version weight of the ``weighted`` sampling preference."""
    eviction: Literal["oldest", "probabilistic"] = "oldest"
    """What makes room in a full buffer: the oldest group, or a random one with probability ∝ age + 1."""
    partial_rollouts: bool = Field(False, json_schema_extra=read_in("lm"))
    """vllm engine, max_staleness > 0: a weight load interrupts the turns in flight, which continue under the new
    weights from the tokens they have (each token keeps the version that sampled it, and the objective's age
    weights and behaviour log-probs are per token); off: a load waits for the turns in flight to finish. With either,
    an episode's next turn is sampled by the newest weights."""
    rollout_timeout: float = Field(1800.0, gt=0.0)
    """concurrent schedule: seconds the learner waits for the rollout thread to write a group while it waits for a
    step's batch (the wait starts again with every group written); past it the run stops with an error (lm runs:
    and a checkpoint of the last finished update), leaving the stuck rollout thread behind."""


# Resources Ray gives every node, which a role asks for with a setting of its own rather than as a custom resource.
BUILTIN_RESOURCES = {
    "CPU": "set ray.{role}_num_cpus instead",
    "GPU": "set ray.rollout_num_gpus instead (a learner rank gets one GPU when device is a GPU)",
    "memory": "Ray sets it per node (`ray start --memory`)",
    "object_store_memory": "Ray sets it per node (`ray start --object-store-memory`)",
}


class RayConfig(Section):
    """``backend: ray``: where the roles of an lm run are placed (``unipg.runtime.backends.ray_lm``, docs/runtime.md)."""

    address: str | None = None
    """None starts a local Ray instance for the run (and stops it at the end); ``auto`` joins the cluster this
    machine belongs to; ``host:port`` or ``ray://host:port`` joins that one."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs of a local instance (None: all of this machine's)."""
    dashboard: bool = False
    """start Ray's dashboard with a local instance (bound to 127.0.0.1)."""
    runtime_env: dict[str, Any] | None = None
    """Ray runtime environment of the run's actors, e.g. ``{working_dir: ., pip: [...]}`` on a cluster whose
    machines lack unipg. The values of its ``env_vars`` are saved redacted with the run (config.yaml, TensorBoard,
    W&B), except those of a few settings (``unipg.config.secrets.CLEAR_ENV_VARS``) and of
    ``env_vars_in_clear``; a resumed run reads the others again from overrides or the environment."""
    env_vars_in_clear: list[str] = Field(default_factory=list)
    """names of environment variables that hold no secret, whose values are saved in clear with the run: in
    ``runtime_env.env_vars`` and in every other ``env``, ``env_vars`` or ``environment`` mapping of the config
    (an MCP tool server's ``env``, a plugin's), which are otherwise saved redacted."""
    rollout_workers: int = Field(2, ge=1)
    """rollout worker actors; each runs episodes on its own copy of the policy."""
    rollout_num_cpus: float = Field(1.0, ge=0.0)
    """CPUs reserved per rollout worker."""
    rollout_num_gpus: float = Field(0.0, ge=0.0)
    """GPUs per rollout worker (its policy copy is moved to the GPU when > 0)."""
    episodes_per_worker: int | None = Field(None, ge=1)
    """episodes in flight on one worker at once (None: ``agent.concurrency``); the staleness gate bounds the
    total."""
    env_workers: int = Field(1, ge=0)
    """environment actors running tool calls (0: each rollout worker runs its tools itself)."""
    env_num_cpus: float = Field(0.25, ge=0.0)
    """CPUs reserved per environment actor."""
    placement: Literal["none", "pack", "spread"] = "none"
    """place rollout workers in a placement group: ``pack`` on as few machines as possible, ``spread`` over
    as many; ``none`` leaves it to Ray's scheduler."""
    learner_num_cpus: float = Field(1.0, gt=0.0)
    """CPUs reserved per learner rank when ``train.learner_processes`` > 1 (each rank also gets one GPU when
    ``device`` is a GPU)."""
    learner_placement: Literal["pack", "spread"] = "pack"
    """where the learner ranks' placement group puts them: ``pack`` on as few machines as possible (fast
    collectives), ``spread`` over as many (one rank per machine where there are enough)."""
    start_timeout: float = Field(180.0, gt=0.0)
    """seconds an actor or the placement group may take to start before the run stops with an error."""
    episode_timeout: float = Field(600.0, gt=0.0)
    """seconds a group of episodes may run on a worker; past it the worker is replaced and the group run again."""
    max_attempts: int = Field(3, ge=1)
    """runs of one group (first run included) before it is given up and counted as failed."""
    max_restarts: int = Field(10, ge=0)
    """rollout worker replacements in a run (after a crash, a kill or a hung group) before the run stops."""
    health_timeout: float = Field(10.0, gt=0.0)
    """seconds an environment actor may take to answer a health check after a tool call timed out on it;
    an actor that does not, or whose tool is still running past ``agent.tool_timeout``, is restarted."""
    call_timeout: float = Field(1800.0, gt=0.0)
    """seconds a call to the learner's ranks (``train.learner_processes`` > 1: an update, a checkpoint) may take;
    past it, or when a rank's actor dies, the run stops with an error naming the rank."""
    rollout_resources: dict[str, float] = Field(default_factory=dict)
    """custom Ray resources each rollout worker asks for, e.g. ``{rollout: 1}`` to run the workers only on nodes
    started with ``ray start --resources '{"rollout": 4}'``."""
    env_resources: dict[str, float] = Field(default_factory=dict)
    """custom Ray resources each environment actor asks for (as ``rollout_resources``)."""
    learner_resources: dict[str, float] = Field(default_factory=dict)
    """custom Ray resources each learner rank asks for when ``train.learner_processes`` > 1 (as
    ``rollout_resources``)."""

    @field_validator("rollout_resources", "env_resources", "learner_resources", mode="before")
    @classmethod
    def _custom_resources(cls, resources: Any, info: ValidationInfo) -> Any:
        if not isinstance(resources, dict):
            return resources  # pydantic says what a mapping should be
        role = info.field_name.removesuffix("_resources")
        for name, amount in resources.items():
            if name in BUILTIN_RESOURCES:
                raise ValueError(f"{name!r} is not a custom resource: {BUILTIN_RESOURCES[name].format(role=role)}")
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0 < amount < float("inf"):
                raise ValueError(f"the amount of {name!r} ({amount!r}) must be a number > 0, e.g. {{{name}: 1}}")
            if amount > 1 and amount != int(amount):
                raise ValueError(
                    f"the amount of {name!r} ({amount:g}) must be a whole number when above 1 (Ray's rule), "
                    f"e.g. {int(amount)} or {int(amount) + 1}"
                )
        return resources


class LogConfig(Section):
    """Where and how a run records itself."""

    output_dir: str = "runs"
    """directory under which each run gets its own folder."""
    run_name: str | None = None
    """folder name of the run, created under output_dir; default: <algorithm>-<env>-seed<seed>-<time>. With
    ``--seeds`` each seed's folder is <run_name>-seed<seed>."""
    tensorboard: bool = True
    """also write TensorBoard event files (metrics.jsonl is always written)."""
    progress: bool = True
    """show a progress bar on a terminal (plain lines when output is not a terminal)."""
    log_every_updates: int = Field(1, ge=1)
    """write training metrics every this many learner updates."""
    wandb: bool = False
    """also log to Weights & Biases (pip install 'unipg[wandb]'); the configuration is the run's config."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """offline writes under the run folder with no network (upload later with `wandb sync`)."""
    wandb_project: str = "unipg"
    """Weights & Biases project of the run."""
    monitor: bool = True
    """run the doctor's checks live on the logged metrics and warn when a condition begins."""
    episodes: bool = False
    """lm runs: append every trained episode to <run>/episodes.jsonl (one record per episode and role: chat
    messages, rewards, token ids, behaviour log-probs, versions), the format ``data.offline.path`` reads."""

    @field_validator("run_name")
    @classmethod
    def _plain_folder_name(cls, name: str | None) -> str | None:
        # '..', '/x' or 'a/../../b' would put the run, and its config.yaml, outside output_dir; 'sweep1/lr3e-4'
        # (a folder per sweep) stays inside it
        parts = name.replace("\\", "/").split("/") if name is not None else []
        if name is not None and (
            name.startswith(("/", "\\")) or any(part.strip() in ("", ".", "..") for part in parts)
        ):
            raise ValueError(
                "run_name must be a relative folder path such as 'baseline-1' or 'sweep1/lr3e-4', "
                "without '..', '.' or empty parts; the folder is made under log.output_dir"
            )
        return name


class MixSchedule(Section):
    """A share that moves linearly from ``start`` to ``end`` over the first ``updates`` learner updates."""

    start: float = Field(..., ge=0.0, le=1.0)
    """share at update 1."""
    end: float = Field(..., ge=0.0, le=1.0)
    """share from update ``updates`` + 1 on."""
    updates: int = Field(..., ge=1)
    """updates over which the share moves from start to end."""


class OfflineConfig(Section):
    """Recorded episodes mixed into every learner batch beside the fresh ones (``unipg.runtime.offline``)."""

    path: str
    """a JSONL file of episodes, one JSON object per line (``log.episodes`` writes this format; docs/agents.md)."""
    mix: float | MixSchedule = Field(0.25)
    """share of each batch's prompt groups taken from the file: a number, or {start, end, updates} for a linear
    schedule; at least one group per batch stays fresh."""
    age: int | None = Field(None, ge=0)
    """the age every offline sample is given (fixed); None: version −1, one version older than the learner's
    first weights, so the age grows by one per update (learner version + 1)."""
    only_correct: bool = False
    """keep only records whose episode was completed correctly."""

    @field_validator("mix")
    @classmethod
    def _a_share(cls, mix: float | MixSchedule) -> float | MixSchedule:
        if isinstance(mix, (int, float)) and not 0.0 <= mix <= 1.0:
            raise ValueError(
                f"mix ({mix}) is the share of each batch taken from the file: a number in [0, 1], or "
                "{start: 0.5, end: 0.0, updates: 20} for a linear schedule"
            )
        return mix


class DataConfig(Section):
    """Data that does not come from this run's own rollouts."""

    offline: OfflineConfig | None = None
    """recorded episodes mixed with online samples, e.g. {path: runs/a/episodes.jsonl, mix: 0.5}."""
