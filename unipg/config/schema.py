"""The configuration schema: one typed, documented section per concern, and the run's ``Config``.

The sections of classic-control training and of the gradient estimate are here; those of text tasks are in
``unipg.config.lm`` and those of how a run executes and records itself in ``unipg.config.run``, all
importable from here.

``load_config`` (in ``unipg.config.loading``, re-exported here) builds a ``Config`` from a YAML file and
dotted overrides and rejects bad input with a message that says what to fix.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from unipg.config.lm import (
    AgentConfig,
    CheckpointConfig,
    EndpointConfig,
    ModelConfig,
    RoleConfig,
    RollbackConfig,
    SampleConfig,
    SFTConfig,
    SFTStage,
    TaskConfig,
)
from unipg.config.run import DataConfig, EvalConfig, LogConfig, MixSchedule, OfflineConfig, RayConfig, RuntimeConfig
from unipg.config.secrets import redact_secrets, restore_secrets
from unipg.config.section import (  # ConfigError: the error callers catch
    ConfigError,
    Section,
    read_in,
)


class EnvConfig(Section):
    """Where classic-control data comes from: a vector of gymnasium environments."""

    id: str = "CartPole-v1"
    """gymnasium environment id (any registered id with a Box observation space)."""
    num_envs: int = Field(4, ge=1)
    """environments stepped in lock-step; each contributes batch_transitions / num_envs steps per update."""
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


class EstimatorConfig(Section):
    """How the gradient is estimated (Q2): advantages, the policy loss and its regularisers."""

    advantage: str = "gae"
    """advantage estimator, a name from unipg.estimate.ADVANTAGES (gae, td, reward_to_go, ...)."""
    policy_loss: str = "ppo"
    """policy loss, a name from unipg.estimate.POLICY_LOSSES (vanilla, ppo, gspo, cispo, sapo, ...) or 'trpo'."""
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
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """grpo: divide the group-centred score by the group's std, the whole batch's std, or nothing (Dr.GRPO)."""
    advantage_eps: float = Field(1e-6, gt=0.0)
    """grpo: ε added to the std before dividing, so that a group whose samples agree gets 0, not NaN."""
    normalize_advantages: bool = True
    """whiten advantages per mini-batch (mean 0, std 1)."""
    normalize_rewards: bool = False
    """scale rewards by a running estimate of the std of the discounted return."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """weight of the entropy bonus."""
    top_entropy_quantile: float = Field(1.0, gt=0.0, le=1.0)
    """share of the valid tokens, those of highest entropy, that carry the policy gradient (Wang et al. 2025,
    "Beyond the 80/20 Rule": 0.2); 1 = every token."""
    value_loss_coef: float = Field(0.5, ge=0.0)
    """weight of the critic's loss when actor and critic share one optimizer step."""
    value_clip_range: float | None = Field(None, gt=0.0)
    """clip the value update around the rollout-time value (PPO2); None = plain MSE."""
    loss_agg_mode: str = Field("token-mean", json_schema_extra=read_in("lm"))
    """how per-sample losses are reduced: token-mean, seq-mean-token-mean, seq-mean-token-sum, ..."""
    kl_coef: float = Field(0.0, ge=0.0, json_schema_extra=read_in("lm"))
    """weight of the KL penalty to the reference model (language models)."""
    kl_estimator: str = Field("k3", json_schema_extra=read_in("lm"))
    """per-token KL estimator for the reference penalty, a name from unipg.estimate.KL_ESTIMATORS (k1, k2, k3)."""
    kl_control: Literal["fixed", "adaptive"] = Field("fixed", json_schema_extra=read_in("lm"))
    """fixed kl_coef, or adapt it so the observed KL tracks target_kl (Ziegler et al. 2019)."""
    target_kl: float | None = Field(None, gt=0.0, json_schema_extra=read_in("lm"))
    """target KL for adaptive KL control."""
    kl_horizon: int = Field(10_000, ge=1, json_schema_extra=read_in("lm"))
    """horizon (in samples) of the adaptive KL controller."""
    ref_sync_steps: int | None = Field(None, ge=1, json_schema_extra=read_in("lm"))
    """lm runs: every this many learner updates, move the reference model towards the policy, θ_ref ← α θ +
    (1 − α) θ_ref with α = ref_sync_alpha (TR-DPO, Gorbatovski et al. 2024; TRL's sync_ref_model and
    ref_model_sync_steps); None keeps the reference frozen. Needs a reference copy (kl_coef > 0 or
    model.reference=copy), not LoRA's adapter-off base weights; checkpoints then hold the moved reference."""
    ref_sync_alpha: float = Field(0.6, gt=0.0, le=1.0, json_schema_extra=read_in("lm"))
    """lm runs with ref_sync_steps: the policy's weight α in each reference update (TRL's ref_model_mixup_alpha;
    1 resets the reference to the policy)."""
    mask_truncated_completions: bool = Field(False, json_schema_extra=read_in("lm"))
    """lm runs: leave cut completions out of the loss (they still count in their group's baseline), as TRL's
    mask_truncated_completions and DAPO's overlong filtering: a cut answer is not a wrong one. Cut: an episode whose
    last turn stopped at its token budget (sample.max_new_tokens or the room left), graded or not, or that ran out
    of room for its next turn (finish "max_tokens")."""
    kl_in_reward: bool = Field(False, json_schema_extra=read_in("lm"))
    """lm runs: subtract kl_coef·KL_t from each token's reward (classic RLHF PPO, REINFORCE++) instead of
    adding the KL as a loss term (GRPO)."""
    off_policy_weight: str = "none"
    """weight w(ρ, age) of the unified objective, a name from unipg.estimate.OFF_POLICY_WEIGHTS."""
    behaviour_weight_cap: float | None = Field(None, gt=0.0)
    """decoupled_ppo: truncate the behaviour weight π_prox/μ at this value (None: no cap; AReaL uses 5)."""
    weight_clip_low: float | None = Field(None, ge=0.0, le=1.0)
    """cispo: the importance weight is clipped below at 1 − weight_clip_low (None: no lower bound, as MiniMax-M1)."""
    weight_clip_high: float | None = Field(0.2, ge=0.0)
    """cispo: the importance weight is clipped above at 1 + weight_clip_high (None: no upper bound)."""
    sapo_tau_pos: float = Field(1.0, gt=0.0)
    """sapo: gate temperature τ for tokens with a positive advantage (larger: the gate closes sooner)."""
    sapo_tau_neg: float = Field(1.05, gt=0.0)
    """sapo: gate temperature τ for tokens with a non-positive advantage (the paper: slightly above sapo_tau_pos)."""
    vespo_k_pos: float = Field(2.0, ge=0.0)
    """vespo: exponent k of the kernel W^k e^{λ(1−W)} for responses with a non-negative advantage."""
    vespo_lambda_pos: float = Field(3.0, ge=0.0)
    """vespo: decay λ of the kernel for responses with a non-negative advantage (larger: off-policy ones fade sooner)."""
    vespo_k_neg: float = Field(3.0, ge=0.0)
    """vespo: exponent k of the kernel for responses with a negative advantage."""
    vespo_lambda_neg: float = Field(2.0, ge=0.0)
    """vespo: decay λ of the kernel for responses with a negative advantage."""
    clip_cov_ratio: float = Field(2e-4, gt=0.0, le=1.0)
    """clip_cov: share of the valid tokens whose gradient is dropped, drawn among those with covariance in (lb, ub)."""
    clip_cov_lb: float = 1.0
    """clip_cov: lower bound of the token covariance (A − mean A)(log π − mean log π) of a droppable token."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper bound of the token covariance of a droppable token."""
    kl_cov_ratio: float = Field(2e-3, gt=0.0, le=1.0)
    """kl_cov: share of the valid tokens, those of largest covariance, that pay the |log ρ| penalty."""
    kl_cov_coef: float = Field(1.0, ge=0.0)
    """kl_cov: weight β of the |log ρ| penalty on the selected tokens."""
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
    batch_size: int = Field(64, ge=1, json_schema_extra=read_in("lm"))
    """language-model runs: completions (trajectories) per learner update, samples_per_prompt per prompt."""
    mini_batch_size: int = Field(64, ge=1, json_schema_extra=read_in("lm"))
    """language-model runs: completions per optimizer step; must divide batch_size."""
    batch_transitions: int = Field(512, ge=1, json_schema_extra=read_in("gym"))
    """gymnasium runs: environment transitions per learner update (num_envs × steps per environment)."""
    mini_batch_transitions: int = Field(128, ge=1, json_schema_extra=read_in("gym"))
    """gymnasium runs: transitions per optimizer step; must divide batch_transitions."""
    num_epochs: int = Field(4, ge=1)
    """passes over each batch."""
    max_grad_norm: float | None = Field(0.5, gt=0.0)
    """global gradient-norm clip; None disables it."""
    critic_updates: int = Field(5, ge=1, json_schema_extra=read_in("gym"))
    """TRPO: epochs of critic regression per update (the actor takes one natural-gradient step)."""
    updates: int = Field(100, ge=1, json_schema_extra=read_in("lm"))
    """lm runs: learner updates after which training stops (gym runs stop at env.total_steps)."""
    micro_batch_size: int = Field(64, ge=1, json_schema_extra=read_in("lm"))
    """lm runs: sequences per forward pass; gradients of a mini-batch are accumulated over micro-batches."""
    max_tokens_per_micro_batch: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(
        "auto", json_schema_extra=read_in("lm")
    )
    """lm runs: micro-batches by token count, each packed into one row without padding (at most this many prompt +
    completion tokens each, balanced; a longer sequence is a micro-batch of its own); None = micro_batch_size
    sequences padded to the longest; auto = packed at micro_batch_size × the mini-batch's longest sequence tokens
    (on sdpa models a packed row holds each GRPO group's prompt once, its completions attending to it); on other
    attention implementations padded instead where that is faster (it runs a group's shared prompt once: long
    shared prompts before even completions) (``unipg.learn.micro_batches``)."""
    learner_processes: int = Field(1, ge=1)
    """lm runs: ranks the learner is sharded over with FSDP2 (gloo on CPU, NCCL on GPU): local processes with
    backend=inprocess, Ray actors in a placement group with backend=ray (``ray.learner_*``); the driver's process
    keeps an unsharded copy for rollout and evaluation, refreshed after every update."""
    learner_timeout: float = Field(1800.0, gt=0.0, json_schema_extra=read_in("lm"))
    """lm runs with learner_processes > 1: seconds a rank may wait for its peers in the process group's rendezvous
    or in one collective (torch.distributed's timeout, gloo and NCCL), and, with backend=inprocess, seconds the
    driver waits for every rank to answer one call (starting, an update, a checkpoint; with backend=ray that is
    ``ray.call_timeout``). Past it the run stops with an error naming the ranks; its newest checkpoint is kept."""
    logprob_chunk_tokens: int | None = Field(None, ge=1, json_schema_extra=read_in())
    """replaced by model.logits_chunk_tokens, which chunks the logits themselves, not only their log-softmax."""
    weight_decay: float = Field(0.0, ge=0.0, json_schema_extra=read_in("lm"))
    """lm runs: AdamW weight decay."""
    tis: Literal["auto", "on", "off"] = Field("auto", json_schema_extra=read_in("lm"))
    """lm runs: measure and correct the gap between the inference engine's log-probs and the trainer's with
    truncated importance sampling (``unipg.learn.objective``); auto = on whenever the engine is not the trainer's
    own model (``sample.engine`` other than hf). On costs one more forward pass per update."""
    tis_cap: float = Field(2.0, gt=0.0, json_schema_extra=read_in("lm"))
    """lm runs with tis: the engine-gap weight is min(π_trainer / μ_engine, tis_cap) on tokens of the current
    version."""


class Config(Section):
    """A complete run: one answer to each of the three questions plus run settings."""

    algorithm: str = "ppo"
    """named preset (ppo, trpo, a2c, reinforce, ...) that fills defaults the user did not set."""
    seed: int = Field(0, ge=0, lt=2**31)
    """seed of every random number generator of the run (numpy takes seeds below 2**32; the bound leaves room
    for the per-worker and per-evaluation offsets added to it)."""
    deterministic: bool = False
    """use deterministic torch kernels and a single thread (bitwise-reproducible on CPU)."""
    device: str = Field("cpu", json_schema_extra=read_in("lm"))
    """where the models live: cpu, cuda, cuda:N, mps, or auto (CUDA when this machine has it, else the CPU). lm
    runs put the policy, critic, reference, reward model and SFT warm start there; gymnasium runs keep their MLPs
    on the CPU. A device that is asked for and absent is refused when the config loads (``unipg.config.devices``)."""
    backend: str = "inprocess"
    """lm runs: where episodes run, a name from unipg.runtime.backends.BACKENDS: ``inprocess`` (threads of this
    process) or ``ray`` (rollout workers and environment actors on a Ray cluster, section ``ray``); the learner
    and the buffer stay in this process."""
    plugins: list[str] = Field(default_factory=list)
    """modules (``my_package.tasks``) or Python files (``./my_tools.py``, relative to the config file) imported
    before the config is checked, so that the tasks, tools, rewards, environments and estimators they register
    can be named in it (``unipg.config.plugins``); stored with file paths made absolute."""
    threads: int | None = Field(None, ge=1)
    """torch intra-op CPU threads; None = 1 for MLPs and the embedded model (their small matrix products run
    fastest on one thread, and extra threads only contend), torch's default for other models and for the
    embedded model's warm start (batched fine-tuning steps, ``unipg.learn.warm_start.warm_start_threads``)."""
    env: EnvConfig = Field(default_factory=EnvConfig, json_schema_extra=read_in("gym"))
    policy: PolicyConfig = Field(default_factory=PolicyConfig, json_schema_extra=read_in("gym"))
    task: TaskConfig = Field(default_factory=TaskConfig, json_schema_extra=read_in("lm"))
    model: ModelConfig = Field(default_factory=ModelConfig, json_schema_extra=read_in("lm"))
    sft: SFTConfig = Field(default_factory=SFTConfig, json_schema_extra=read_in("lm"))
    agent: AgentConfig = Field(default_factory=AgentConfig, json_schema_extra=read_in("lm"))
    endpoint: EndpointConfig = Field(default_factory=EndpointConfig)
    estimator: EstimatorConfig = Field(default_factory=EstimatorConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    sample: SampleConfig = Field(default_factory=SampleConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    rollback: RollbackConfig = Field(default_factory=RollbackConfig, json_schema_extra=read_in("lm"))
    data: DataConfig = Field(default_factory=DataConfig)

    # Not part of the schema: keys the user set that the chosen algorithm does not use.
    warnings: list[str] = Field(default_factory=list, exclude=True)

    @property
    def mode(self) -> str:
        """``lm``: a language model on a text task (``task.name`` is set); ``gym``: an MLP on a gymnasium
        environment. The two modes share estimators, runtime, checkpoints and metrics; their batch sizes
        count different units (``TrainConfig``)."""
        return "lm" if self.task.name is not None else "gym"

    @property
    def is_lm(self) -> bool:
        """Whether this run is in ``lm`` mode (see ``mode``)."""
        return self.mode == "lm"

    @property
    def engine_tis_cap(self) -> float | None:
        """lm runs: ``train.tis_cap`` when the learner corrects the gap between the inference engine's log-probs
        and its own (``train.tis`` on, or auto with an engine other than the trainer's own model: ``sample.engine``
        other than hf), else None."""
        engine = getattr(self.sample, "engine", "hf")  # configurations without an engine setting sample with hf
        on = self.train.tis == "on" or (self.train.tis == "auto" and engine != "hf")
        return self.train.tis_cap if on else None

    @property
    def prompts_per_step(self) -> int:
        """lm runs: distinct prompts per learner update."""
        return self.train.batch_size // self.sample.samples_per_prompt

    @property
    def steps_per_env(self) -> int:
        """Environment steps each environment takes per learner update."""
        return self.train.batch_transitions // self.env.num_envs

    def to_dict(self, *, redacted: bool = False) -> dict[str, Any]:
        """The config as plain data; ``redacted``: its secrets replaced, as a run's saved config.yaml holds them."""
        data = self.model_dump(mode="json")
        return redact_secrets(data) if redacted else data

    @classmethod
    def model_validate(cls, obj: Any, **options: Any) -> Config:
        """Pydantic's ``model_validate``, after ``restore_secrets`` has put back the secrets that
        ``redact_secrets`` took out of a saved config.yaml: a redaction marker never becomes a run's secret."""
        return super().model_validate(restore_secrets(obj) if isinstance(obj, dict) else obj, **options)


__all__ = [
    "AgentConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EndpointConfig",
    "EnvConfig",
    "EstimatorConfig",
    "EvalConfig",
    "LogConfig",
    "MixSchedule",
    "ModelConfig",
    "OfflineConfig",
    "PolicyConfig",
    "RayConfig",
    "RoleConfig",
    "RollbackConfig",
    "RuntimeConfig",
    "SFTConfig",
    "SFTStage",
    "SampleConfig",
    "TaskConfig",
    "TrainConfig",
]
