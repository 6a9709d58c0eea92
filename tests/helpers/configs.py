"""Overrides of short runs on the embedded model: one base list for one-digit arithmetic, each test's changes on
top, and the lists several test modules share."""

from unipg.config import Config, load_config


def tiny_lm_overrides(*changes: str, num_train: int = 40, num_test: int = 8) -> list[str]:
    """Overrides of a short run on ``num_train``/``num_test`` one-digit arithmetic problems (eight completions per
    update: two prompts × four samples of at most four tokens, in one mini-batch; evaluated before the first update
    and after the last; quiet logs), with ``changes`` applied: a change replaces the base entry of its key, and a
    key the base does not set is added.

    >>> overrides = tiny_lm_overrides("train.mini_batch_size=4", "algorithm=grpo", num_test=4)
    >>> overrides[1], overrides[-2:], "train.mini_batch_size=8" in overrides
    ('task.options={digits: 1, num_train: 40, num_test: 4}', ['train.mini_batch_size=4', 'algorithm=grpo'], False)
    """
    base = [
        "task.name=arithmetic",
        f"task.options={{digits: 1, num_train: {num_train}, num_test: {num_test}}}",
        "train.batch_size=8",
        "train.mini_batch_size=8",
        "sample.samples_per_prompt=4",
        "sample.max_new_tokens=4",
        "eval.every_updates=100",
        "log.progress=false",
        "log.tensorboard=false",
    ]
    changed = {change.partition("=")[0] for change in changes}
    return [item for item in base if item.partition("=")[0] not in changed] + list(changes)


# three deterministic PPO updates with a KL penalty; no pass@k, checkpoints or rollback
DETERMINISTIC_PPO = tiny_lm_overrides(
    "train.mini_batch_size=4",
    "train.micro_batch_size=4",
    "eval.pass_k=0",
    "deterministic=true",
    "algorithm=ppo",
    "estimator.kl_coef=0.05",
    "checkpoint.every_updates=0",
    "rollback.enabled=false",
    "train.updates=3",
    num_test=4,
)

# two updates of the default algorithm (PPO), evaluated with pass@2 before the first and after each
TWO_EVALUATED_UPDATES = tiny_lm_overrides(
    "train.micro_batch_size=4", "train.updates=2", "eval.every_updates=1", "eval.pass_k=2"
)

# deterministic PPO on token-budget micro-batches, a checkpoint after every update: a run to compare with one whose
# learner is sharded over processes
CHECKPOINTED_PPO = tiny_lm_overrides(
    "deterministic=true",
    "algorithm=ppo",
    "estimator.kl_coef=0.05",
    "train.num_epochs=1",
    "train.adam_eps=1e-3",
    "train.max_tokens_per_micro_batch=40",
    "checkpoint.every_updates=1",
    "checkpoint.keep_best=false",
)

# deterministic PPO evaluated after every update, keeping the last two of its per-update checkpoints
RESUMABLE_PPO = tiny_lm_overrides(
    "train.mini_batch_size=4",
    "train.micro_batch_size=4",
    "eval.every_updates=1",
    "eval.pass_k=2",
    "deterministic=true",
    "algorithm=ppo",
    "estimator.kl_coef=0.05",
    "checkpoint.every_updates=1",
    "checkpoint.keep_last=2",
    "checkpoint.keep_best=false",
)


def resumable_config(embedded_path, output_dir, name: str, updates: int, *extra: str) -> Config:
    """A ``RESUMABLE_PPO`` run of ``updates`` updates named ``name`` under ``output_dir``."""
    return load_config(
        None,
        RESUMABLE_PPO
        + [
            f"model.name={embedded_path}",
            f"log.output_dir={output_dir}",
            f"log.run_name={name}",
            f"train.updates={updates}",
            *extra,
        ],
    )


# GRPO on two-digit calculator problems whose every training example demonstrates the tool (which answers after a
# simulated lognormal latency); four updates, no checkpoints
CALCULATOR_AGENT = [
    "task.name=calculator",
    "task.options={digits: 2, num_train: 40, num_test: 4, tool_demonstrations: 1.0}",
    "task.tools=[{name: calculator, latency: {kind: lognormal, seconds: 0.005, sigma: 1.5}}]",
    "sample.max_new_tokens=8",
    "agent.max_total_tokens=40",
    "algorithm=grpo",
    "train.batch_size=8",
    "train.mini_batch_size=8",
    "train.micro_batch_size=8",
    "sample.samples_per_prompt=4",
    "eval.every_updates=100",
    "eval.pass_k=0",
    "eval.max_examples=4",
    "log.progress=false",
    "log.tensorboard=false",
    "checkpoint.every_updates=0",
    "train.updates=4",
]

# two GRPO updates on calculator problems whose episodes an external agent plays through the endpoint
EXTERNAL_AGENT_RUN = [
    "task.name=calculator",
    "task.options={digits: 2, num_train: 40, num_test: 4}",
    "task.agent=tests.inference.endpoint.agents_for_tests:two_turns",
    "sample.max_new_tokens=8",
    "algorithm=grpo",
    "train.batch_size=8",
    "train.mini_batch_size=8",
    "train.micro_batch_size=8",
    "sample.samples_per_prompt=4",
    "eval.every_updates=2",
    "eval.pass_k=0",
    "eval.max_examples=4",
    "log.progress=false",
    "log.tensorboard=false",
    "checkpoint.every_updates=0",
    "rollback.enabled=false",
    "train.updates=2",
]


def tiny_team_overrides(*changes: str) -> list[str]:
    """Overrides of a short run of the solver–checker task (one verdict per episode, so every episode ends within its
    budget; the entropy bonus gives every row with a sampled token a gradient, whatever its advantage; a checkpoint
    every update), with ``changes`` (e.g. the role policy) after them."""
    return [
        "task.options={digits: 2, num_train: 30, num_test: 4, max_rounds: 1}",
        "model.warm_start=false",
        "sample.samples_per_prompt=2",
        "sample.max_new_tokens=12",
        "agent.max_total_tokens=48",
        "train.batch_size=4",
        "train.mini_batch_size=4",
        "train.micro_batch_size=4",
        "estimator.entropy_coef=0.01",
        "eval.every_updates=2",
        "eval.max_examples=2",
        "checkpoint.every_updates=1",
        "deterministic=true",
        "log.progress=false",
        "log.tensorboard=false",
        *changes,
    ]
