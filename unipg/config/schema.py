"""The configuration schema: one typed, documented section per concern, and the run's ``Config``.

``load_config`` (in ``unipg.config.loading``, re-exported here) builds a ``Config`` from a YAML file and
dotted overrides and rejects bad input with a message that says what to fix.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from unipg.config.secrets import restore_secrets
from unipg.config.section import ConfigError, Section  # noqa: F401  (ConfigError: the error callers catch)


class EnvConfig(Section):
    """Where classic-control data comes from: a vector of gymnasium environments."""

    id: str = "CartPole-v1"
    """gymnasium environment id (any registered id with a Box observation space)."""
    num_envs: int = Field(4, ge=1)
    """environments stepped in lock-step; each contributes batch_size / num_envs steps per update."""
    total_steps: int = Field(100_000, ge=1)
    """environment steps (summed over all environments) after which training stops."""
    max_episode_steps: int | None = Field(None, ge=1)
    """override of the environment's time limit (None keeps the registered one)."""


class PolicyConfig(Section):
    """The MLP actor-critic used for gymnasium environments."""

    hidden_sizes: list[int] = Field(default_factory=lambda: [64, 64])
    """widths of the hidden layers of both the actor and the critic."""
    activation: Literal["tanh", "relu"] = "tanh"
    """hidden-layer non-linearity."""
    log_std_init: float = 0.0
    """initial log standard deviation of the Gaussian policy (continuous actions only)."""

    @field_validator("hidden_sizes")
    @classmethod
    def _positive_widths(cls, sizes: list[int]) -> list[int]:
        if not sizes or any(size < 1 for size in sizes):
            raise ValueError("hidden_sizes must be a non-empty list of positive widths, e.g. [64, 64]")
        return sizes


class ModelConfig(Section):
    """The language model trained on text tasks (Q1 for text): any Hugging Face causal LM."""

    name: str = "embedded"
    """hub id or local path of an AutoModelForCausalLM, or 'embedded' / 'embedded:small' for the built-in model."""
    warm_start: bool = False
    """fine-tune the model on the task's demonstrations (section sft) before RL; the result is cached."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """parameter dtype of the policy, critic and reference."""
    value_head: bool = False
    """add a value head (critic) on the policy's last hidden state; PPO needs a critic."""
    critic: str | None = None
    """hub id or path of a separate critic model (its own backbone + value head) instead of a shared head."""
    reference: Literal["auto", "copy", "none"] = "auto"
    """frozen reference for the KL penalty: auto = needed only when kl_coef > 0 or KL is adaptive (with LoRA the
    adapter-disabled model is the reference and no copy is held)."""
    lora_rank: int = Field(0, ge=0)
    """LoRA rank; 0 trains all weights (LoRA needs the peft extra)."""
    lora_alpha: float = Field(16.0, gt=0.0)
    """LoRA scaling α."""
    lora_target_modules: str | list[str] = "all-linear"
    """modules LoRA adapts ('all-linear' or a list of module names)."""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory."""
    trust_remote_code: bool = False
    """allow model code from the hub repository (only for models you trust)."""


class TaskConfig(Section):
    """A single-turn text task with rule-based rewards; setting ``name`` switches training to language models."""

    name: str | None = None
    """task name (arithmetic, gsm8k); None trains on the gymnasium environment of section env."""
    options: dict[str, Any] = Field(default_factory=dict)
    """task options, e.g. {digits: 3} for arithmetic or {path: data/gsm8k.jsonl} for gsm8k."""
    rewards: list[dict[str, Any]] | None = None
    """reward functions and weights, e.g. [{name: math, weight: 1.0}, {name: format, weight: 0.1}];
    None = the task's default."""
    system_prompt: str | None = None
    """system message put before every prompt (None = the task's own, if any)."""
    tools: list[dict[str, Any]] | None = None
    """tools the agent may call, e.g. [{name: calculator}, {name: python, options: {timeout: 5}}];
    None = the task's default (single-turn tasks have none)."""


class AgentConfig(Section):
    """Multi-turn episodes: turn budget, the environment service's failure policy, process rewards."""

    max_turns: int | None = Field(None, ge=1)
    """policy turns per episode (generate → tool → generate ...); None = the task's default."""
    max_total_tokens: int = Field(384, ge=1)
    """token budget of an episode after its prompt (sampled + inserted tokens); the episode ends when spent."""
    concurrency: int = Field(256, ge=1)
    """episodes in flight at once; their generation requests are batched together."""
    batch_wait_ms: float = Field(5.0, ge=0.0)
    """how long the inference batcher waits for more requests while some episodes are busy with tools."""
    tool_timeout: float = Field(10.0, gt=0.0)
    """seconds one tool call may take before it counts as failed."""
    tool_retries: int = Field(2, ge=0)
    """extra attempts after a failed or timed-out tool call."""
    retry_backoff: float = Field(0.05, ge=0.0)
    """seconds before the first retry, doubled after each further failure."""
    default_observation: str = "tool unavailable"
    """what the agent sees when a tool failed on every attempt."""
    failure_penalty: float = Field(0.1, ge=0.0)
    """reward subtracted on a turn whose tool call failed on every attempt."""
    process_weight: float = Field(0.1, ge=0.0)
    """weight of process rewards (valid call and tool success: +; malformed call: −) relative to a final
    reward of 1; positive process reward is capped at this weight per episode, so extra calls never pay."""
    tool_prompt: bool = True
    """describe the tools to the model: through the chat template's tools argument when it has one, else in
    the system message."""


class SFTStage(Section):
    """An earlier supervised stage on the same task built with other options (a curriculum)."""

    steps: int = Field(..., ge=1)
    """optimizer steps of this stage."""
    options: dict[str, Any] = Field(default_factory=dict)
    """task options that replace the run's task.options for this stage, e.g. {tool_demonstrations: 1.0}."""
    learning_rate: float | None = Field(None, gt=0.0)
    """peak learning rate of this stage (None = sft.learning_rate)."""
    batch_size: int | None = Field(None, ge=1)
    """demonstrations per step in this stage (None = sft.batch_size)."""


class SFTConfig(Section):
    """Supervised warm start on the task's demonstrations (completion-only loss)."""

    stages: list[SFTStage] = Field(default_factory=list)
    """stages run in order before the main stage, each on the task rebuilt with its own options: e.g. first
    only demonstrations that use a tool (to learn the skill quickly), then the run's own mixture."""

    steps: int = Field(600, ge=1)
    """optimizer steps."""
    batch_size: int = Field(64, ge=1)
    """demonstrations per step."""
    learning_rate: float = Field(1e-3, gt=0.0)
    """peak learning rate (linear warm-up, then cosine decay to 10%)."""
    examples: int | None = Field(None, ge=1)
    """use only the first this many training demonstrations (None = all)."""
    group_by_length: bool = False
    """batch demonstrations of similar length together: much less padding when lengths vary widely. Batches
    then alternate between kinds of demonstration (short answers, long tool calls), which can swing a choice
    the mixture decides, such as how often to call a tool; keep it off for such mixtures."""


class EstimatorConfig(Section):
    """How the gradient is estimated (Q2): advantages, the policy loss and its regularisers."""

    advantage: str = "gae"
    """advantage estimator, a name from unipg.estimate.ADVANTAGES (gae, td, reward_to_go, ...)."""
    policy_loss: str = "ppo"
    """policy loss, a name from unipg.estimate.POLICY_LOSSES (vanilla, ppo, decoupled_ppo) or 'trpo'."""
    gamma: float = Field(0.99, ge=0.0, le=1.0)
    """discount factor γ."""
    lambda_gae: float = Field(0.95, ge=0.0, le=1.0)
    """GAE λ: 0 is the one-step TD residual, 1 the Monte-Carlo return minus the value."""
    clip_range: float = Field(0.2, gt=0.0, lt=1.0)
    """PPO ε (the lower side ε_low when clip_range_high is set)."""
    clip_range_high: float | None = Field(None, gt=0.0)
    """upper clip ε_high for asymmetric clipping (DAPO 'clip-higher'); None = clip_range."""
    dual_clip: float | None = Field(None, gt=1.0)
    """dual-clip constant c > 1 bounding the loss of negative-advantage samples (Ye et al. 2020)."""
    normalize_advantages: bool = True
    """whiten advantages per mini-batch (mean 0, std 1)."""
    normalize_rewards: bool = False
    """scale rewards by a running estimate of the std of the discounted return."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """weight of the entropy bonus."""
    value_loss_coef: float = Field(0.5, ge=0.0)
    """weight of the critic's loss when actor and critic share one optimizer step."""
    value_clip_range: float | None = Field(None, gt=0.0)
    """clip the value update around the rollout-time value (PPO2); None = plain MSE."""
    loss_agg_mode: str = "token-mean"
    """how per-sample losses are reduced: token-mean, seq-mean-token-mean, seq-mean-token-sum, ..."""
    kl_coef: float = Field(0.0, ge=0.0)
    """weight of the KL penalty to the reference model (language models)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """per-token KL estimator for the reference penalty."""
    kl_control: Literal["fixed", "adaptive"] = "fixed"
    """fixed kl_coef, or adapt it so the observed KL tracks target_kl (Ziegler et al. 2019)."""
    target_kl: float | None = Field(None, gt=0.0)
    """target KL for adaptive KL control."""
    kl_horizon: int = Field(10_000, ge=1)
    """horizon (in samples) of the adaptive KL controller."""
    kl_in_reward: bool = False
    """text tasks: subtract kl_coef·KL_t from each token's reward (classic RLHF PPO, REINFORCE++) instead of
    adding the KL as a loss term (GRPO)."""
    off_policy_weight: str = "none"
    """weight w(ρ, age) of the unified objective, a name from unipg.estimate.OFF_POLICY_WEIGHTS."""
    behaviour_weight_cap: float | None = Field(None, gt=0.0)
    """decoupled_ppo: truncate the behaviour weight π_prox/μ at this value (None: no cap; AReaL uses 5)."""
    sample_age_decay: float = Field(0.99, gt=0.0, le=1.0)
    """γ_age of the age-decay weight w = γ_age^age (seed 000: 0.99)."""
    is_truncation: float = Field(2.0, gt=0.0)
    """truncated importance sampling: w = min(ρ, is_truncation)."""
    kl_filter_threshold: float = Field(0.1, gt=0.0)
    """KL filter: sequences whose KL(μ‖π) exceeds this are dropped or down-weighted."""
    kl_filter_mode: Literal["drop", "downweight"] = "drop"
    """KL filter: drop offending sequences (w = 0) or scale them by threshold / KL."""
    version_window: int = Field(4, ge=0)
    """version window: keep samples at most this many policy versions old."""
    max_kl: float = Field(0.01, gt=0.0)
    """TRPO trust-region radius δ on the mean KL(π_old‖π_new)."""
    cg_iterations: int = Field(10, ge=1)
    """TRPO conjugate-gradient iterations."""
    cg_damping: float = Field(0.1, ge=0.0)
    """TRPO damping added to the Fisher-vector product."""
    line_search_steps: int = Field(10, ge=1)
    """TRPO backtracking line-search attempts."""
    backtrack_coef: float = Field(0.8, gt=0.0, lt=1.0)
    """TRPO step shrink factor per line-search attempt."""


class TrainConfig(Section):
    """The learner: optimisation of the actor and the critic."""

    learning_rate: float = Field(3e-4, gt=0.0)
    """actor learning rate (and critic's, unless critic_learning_rate is set)."""
    critic_learning_rate: float | None = Field(None, gt=0.0)
    """critic learning rate when it should differ from learning_rate (TRPO: the only optimizer)."""
    lr_schedule: Literal["constant", "linear"] = "constant"
    """constant, or linear decay to 0 over training."""
    adam_eps: float = Field(1e-5, gt=0.0)
    """Adam ε."""
    batch_size: int = Field(512, ge=1)
    """samples per learner update: environment transitions for gymnasium tasks (num_envs × steps per env)."""
    mini_batch_size: int = Field(128, ge=1)
    """samples per optimizer step; must divide batch_size."""
    num_epochs: int = Field(4, ge=1)
    """passes over each batch."""
    max_grad_norm: float | None = Field(0.5, gt=0.0)
    """global gradient-norm clip; None disables it."""
    critic_updates: int = Field(5, ge=1)
    """TRPO: epochs of critic regression per update (the actor takes one natural-gradient step)."""
    updates: int = Field(100, ge=1)
    """text tasks: learner updates after which training stops (gymnasium tasks stop at env.total_steps)."""
    micro_batch_size: int = Field(64, ge=1)
    """text tasks: sequences per forward pass; gradients of a mini-batch are accumulated over micro-batches."""
    weight_decay: float = Field(0.0, ge=0.0)
    """text tasks: AdamW weight decay."""


class SampleConfig(Section):
    """How completions are sampled for text tasks (unused by gymnasium training)."""

    samples_per_prompt: int = Field(8, ge=1)
    """completions sampled per prompt: the group of GRPO and RLOO; batch_size / samples_per_prompt prompts per update."""
    max_new_tokens: int = Field(64, ge=1)
    """longest completion in tokens; must be below the model's context length (checked when the model loads)."""
    temperature: float = Field(1.0, ge=0.0)
    """sampling temperature (0 = greedy); log-probs are those of softmax(logits / temperature)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """nucleus sampling: keep the smallest token set with probability ≥ top_p."""
    top_k: int | None = Field(None, ge=1)
    """keep only the k most likely tokens (None = all)."""
    stop: list[str] = Field(default_factory=list)
    """strings that end a completion (besides the EOS token); the text is cut before them."""
    max_prompt_length: int = Field(512, ge=1)
    """prompts longer than this many tokens keep their last max_prompt_length tokens. Where a prompt and its
    completion would outgrow the model's context, the completion stops there (finish reason "length"); a prompt
    that fills the context by itself is an error."""
    rollout_steps: int = Field(512, ge=1)
    """trajectories the rollout side produces per learner step."""
    replay_buffer_size: int = Field(4096, ge=1)
    """capacity of the replay buffer in trajectories."""


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


class RayConfig(Section):
    """``backend: ray``: where the roles of a text run are placed (``unipg.runtime.backends.ray_lm``, docs/runtime.md)."""

    address: str | None = None
    """None starts a local Ray instance for the run (and stops it at the end); ``auto`` joins the cluster this
    machine belongs to; ``host:port`` or ``ray://host:port`` joins that one."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs of a local instance (None: all of this machine's)."""
    dashboard: bool = False
    """start Ray's dashboard with a local instance (bound to 127.0.0.1)."""
    runtime_env: dict[str, Any] | None = None
    """Ray runtime environment of the run's actors, e.g. ``{working_dir: ., pip: [...]}`` on a cluster whose
    machines lack unipg."""
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


class EvalConfig(Section):
    """Periodic evaluation on fresh environments."""

    every_steps: int = Field(10_000, ge=1)
    """evaluate every this many environment steps (and once at the end)."""
    episodes: int = Field(20, ge=1)
    """evaluation episodes."""
    deterministic: bool = True
    """act greedily (mode of the policy) during evaluation."""
    every_updates: int = Field(10, ge=1)
    """text tasks: evaluate on the held-out split every this many learner updates (and before and after)."""
    pass_k: int = Field(4, ge=0)
    """text tasks: also report sampled pass@k with this k (0 = greedy pass@1 only)."""
    max_examples: int | None = Field(None, ge=1)
    """text tasks: evaluate on the first this many held-out examples (None = all)."""


class CheckpointConfig(Section):
    """Text tasks: checkpoints under <run>/checkpoints, from which ``unipg train --resume RUN_DIR`` continues."""

    every_updates: int = Field(50, ge=0)
    """save a checkpoint every this many learner updates (0 = only at the end and when interrupted); a
    rollback goes back to the newest checkpoint."""
    keep_last: int = Field(2, ge=1)
    """keep this many newest checkpoints; older ones are deleted (the best one is kept too, see keep_best)."""
    keep_best: bool = True
    """also keep the checkpoint with the best best_metric, however old."""
    best_metric: str = "eval/pass@1"
    """metric, higher is better, that ranks checkpoints for keep_best; only checkpoints saved at an update
    with an evaluation carry it."""


class RollbackConfig(Section):
    """Text tasks: skip updates that blow up and, when they keep doing so, go back to the last checkpoint."""

    enabled: bool = True
    """skip an optimizer step whose loss or gradient norm is not finite, revert an update whose KL spikes (see
    kl_multiple), and roll back to the newest checkpoint after max_trips such updates in a row."""
    kl_multiple: float = Field(10.0, gt=0.0)
    """an update whose approx KL exceeds kl_multiple × estimator.target_kl is reverted (only when target_kl is
    set; the learner then keeps a copy of the parameters and optimizer state during each update)."""
    max_trips: int = Field(3, ge=1)
    """consecutive skipped or reverted updates after which the run rolls back to its newest checkpoint."""
    lr_factor: float = Field(0.5, gt=0.0, le=1.0)
    """multiply the learning rate by this after each rollback (kept in checkpoints, so a resumed run keeps it)."""
    max_rollbacks: int = Field(5, ge=0)
    """stop the run with an error when it would roll back more often than this."""


class LogConfig(Section):
    """Where and how a run records itself."""

    output_dir: str = "runs"
    """directory under which each run gets its own folder."""
    run_name: str | None = None
    """folder name of the run, created under output_dir; default: <algorithm>-<env>-seed<seed>-<time>."""
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

    @field_validator("run_name")
    @classmethod
    def _plain_folder_name(cls, name: str | None) -> str | None:
        # '..', '/x' or 'a/../../b' would put the run, and its config.yaml, outside output_dir; 'sweep1/lr3e-4'
        # (a folder per sweep) stays inside it
        parts = name.replace("\\", "/").split("/") if name is not None else []
        if name is not None and (name.startswith(("/", "\\")) or any(part.strip() in ("", ".", "..") for part in parts)):
            raise ValueError("run_name must be a relative folder path such as 'baseline-1' or 'sweep1/lr3e-4', "
                             "without '..', '.' or empty parts; the folder is made under log.output_dir")
        return name


class Config(Section):
    """A complete run: one answer to each of the three questions plus run settings."""

    algorithm: str = "ppo"
    """named preset (ppo, trpo, a2c, reinforce, ...) that fills defaults the user did not set."""
    seed: int = Field(0, ge=0, lt=2**31)
    """seed of every random number generator of the run (numpy takes seeds below 2**32; the bound leaves room
    for the per-worker and per-evaluation offsets added to it)."""
    deterministic: bool = False
    """use deterministic torch kernels and a single thread (bitwise-reproducible on CPU)."""
    device: str = "cpu"
    """torch device of the learner."""
    backend: Literal["inprocess", "ray"] = "inprocess"
    """text tasks: ``inprocess`` runs rollout in this process (threads); ``ray`` places rollout workers and
    environment actors on a Ray cluster (section ``ray``); the learner and the buffer stay in this process."""
    threads: int | None = Field(None, ge=1)
    """torch intra-op CPU threads; None = 1 for MLPs and the embedded model (their small matrix products run
    fastest on one thread, and extra threads only contend), torch's default for other models."""
    env: EnvConfig = Field(default_factory=EnvConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    estimator: EstimatorConfig = Field(default_factory=EstimatorConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    sample: SampleConfig = Field(default_factory=SampleConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    rollback: RollbackConfig = Field(default_factory=RollbackConfig)

    # Not part of the schema: keys the user set that the chosen algorithm does not use.
    warnings: list[str] = Field(default_factory=list, exclude=True)

    @property
    def is_text(self) -> bool:
        """Whether this run trains a language model on a text task (else an MLP on a gymnasium env)."""
        return self.task.name is not None

    @property
    def prompts_per_step(self) -> int:
        """Text tasks: distinct prompts per learner update."""
        return self.train.batch_size // self.sample.samples_per_prompt

    @property
    def steps_per_env(self) -> int:
        """Environment steps each environment takes per learner update."""
        return self.train.batch_size // self.env.num_envs

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def model_validate(cls, obj: Any, **options: Any) -> Config:
        """Pydantic's ``model_validate``, after ``restore_secrets`` has put back the secrets that
        ``redact_secrets`` took out of a saved config.yaml: a redaction marker never becomes a run's secret."""
        return super().model_validate(restore_secrets(obj) if isinstance(obj, dict) else obj, **options)

