"""GRPO side by side with TRL's ``GRPOTrainer``: same model, task and hyperparameters, one process.

What is compared: training throughput (samples/s = sampled completions per second of training wall time,
evaluation excluded) and held-out greedy accuracy (pass@1) before and after training. Both frameworks start
from the same warm-started model (unipg's cached supervised warm start of the config), train on the same
task's training split with its default reward, and are evaluated by the same function, unipg's
``evaluate_lm``, on the same held-out examples, so the two accuracies are measured identically. The runs
alternate per seed (TRL first on even seed positions, unipg first on odd ones) so that machine noise hits
both alike; torch uses ``--threads`` threads for both.

    python benchmarks/vs_trl.py --quick                      # smoke run, about a minute after the warm start
    python benchmarks/vs_trl.py --updates 30 --seeds 0,1,2   # the figures to quote
    python benchmarks/vs_trl.py --updates 30 estimator.kl_coef=0.04   # the config with dotted overrides
    py-spy record -f raw -o trl.txt -- python benchmarks/vs_trl.py --updates 10 --only trl   # one, profiled

On a machine busy with other jobs pass ``--threads 1``: two torch threads on two shared cores spend most of
their time waiting for each other, which slows both frameworks down about tenfold alike and hides the
difference between them.

Same settings, in each framework's terms (unipg key → ``GRPOConfig`` field):

    train.batch_size        B completions per learner update → generation_batch_size (via
                            steps_per_generation = B / micro_batch_size)
    sample.samples_per_prompt  group size G                  → num_generations
    train.micro_batch_size  sequences per forward pass       → per_device_train_batch_size
    train.mini_batch_size   completions per optimizer step   → gradient_accumulation_steps = mini / micro
    train.num_epochs        passes over each batch           → num_iterations (μ)
    train.updates           learner updates U                → max_steps = U · (B / mini) · num_epochs
    sample.max_new_tokens   longest completion               → max_completion_length
    sample.temperature / top_p / top_k                       → temperature / top_p / top_k (None → 0)
    train.learning_rate, lr_schedule                         → learning_rate, lr_scheduler_type, no warm-up
    train.adam_eps, weight_decay, max_grad_norm              → adam_epsilon, weight_decay, max_grad_norm
    estimator.kl_coef (β, k3 estimator, in the loss)         → beta, use_bias_correction_kl=False (TRL's
                                                               default multiplies the KL by the importance
                                                               ratio, which changes its gradient even on-policy)
    estimator.clip_range / clip_range_high                   → epsilon / epsilon_high
    estimator.loss_agg_mode seq-mean-token-mean              → loss_type "grpo"
                            token-mean                       → loss_type "dapo" (token mean over the
                                                               optimizer step, not the micro-batch: "bnpo")
                            seq-mean-token-sum-norm          → loss_type "dr_grpo"
    estimator.advantage grpo / dr_grpo                       → scale_rewards "group" / "none"
    model.dtype float32, no dropout (unipg keeps the model in eval mode)
                                                             → bf16=False, disable_dropout=True
    model.gradient_checkpointing                             → gradient_checkpointing

Both sample U · B completions in total; with mini_batch_size == batch_size and num_epochs == 1 each takes
one optimizer step per generation batch. TRL's generation and loss run through its usual path
(``model.generate``, its fused log-prob head); the optimizer is ``torch.optim.AdamW`` in both
(``optim="adamw_torch_fused"``, as unipg uses the fused AdamW kernel). Given the same completions, advantages and reference log-probs, the two losses
and their gradients agree to float precision (relative difference about 1e-6, loss types grpo and dapo);
what differs is each framework's own sampling and prompt order. Remaining differences, none of which moves
the comparison: the GRPO std epsilon (TRL 1e-4, unipg 1e-6); unipg's ``sample.max_prompt_length`` has no
GRPOConfig field (the task's prompts are far shorter); TRL's training time runs from the start to the end of
its training loop (callbacks ``on_train_begin`` → ``on_train_end``), so its one-off optimizer and data-loader
set-up, like unipg's, is outside the timed span.
"""

from __future__ import annotations

import os

# Everything is local: no framework may reach the network (set before transformers / TRL are imported).
for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ[variable] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import functools  # noqa: E402
import importlib.util  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402

import unipg  # noqa: E402, F401  (first: it hides torch companions built for another torch before transformers looks)

EVAL_SEED = 10_000  # pass@1 is greedy, so the seed only matters if eval.pass_k > 0

# Small enough to finish in about a minute on two CPU cores once the warm start is cached.
QUICK_OVERRIDES = [
    "train.batch_size=16",
    "train.mini_batch_size=16",
    "train.micro_batch_size=16",
    "sample.samples_per_prompt=4",
    "eval.max_examples=16",
]

LOSS_TYPES = {"seq-mean-token-mean": "grpo", "token-mean": "dapo", "seq-mean-token-sum-norm": "dr_grpo"}
SCALE_REWARDS = {"grpo": "group", "dr_grpo": "none"}


@dataclass
class RunResult:
    """One framework's run on one seed."""

    framework: str
    seed: int
    samples: int  # sampled completions used for training
    train_seconds: float  # wall time of the training loop, evaluation excluded
    train_reward: float  # mean reward of the sampled completions over the run
    pass_before: float  # held-out greedy pass@1 of the warm-started model
    pass_after: float  # held-out greedy pass@1 after training

    @property
    def samples_per_second(self) -> float:
        return self.samples / max(self.train_seconds, 1e-9)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=30, help="learner updates per run")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds, e.g. 0,1,2")
    parser.add_argument("--config", default="configs/arithmetic_grpo.yaml", help="unipg config both runs follow")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for both frameworks")
    parser.add_argument(
        "overrides",
        nargs="*",
        help="dotted overrides of the config for both runs, e.g. train.learning_rate=3e-5 estimator.kl_coef=0.04",
    )
    parser.add_argument("--quick", action="store_true", help="tiny batches and 2 updates: a smoke run")
    parser.add_argument(
        "--only", choices=["trl", "unipg"], help="run one framework alone (e.g. under a profiler); no ratio then"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="--quick, without the warm start: checks that the script still runs, both frameworks, measures nothing",
    )
    args = parser.parse_args()
    args.quick = args.quick or args.smoke
    return args


def load_benchmark_config(args: argparse.Namespace, seed: int, output_dir: str):
    """The unipg config of one seed: the file plus the benchmark's overrides (no sampled pass@k, no logging)."""
    from unipg.config import load_config

    updates = min(args.updates, 2) if args.quick else args.updates
    overrides = [
        f"seed={seed}",
        f"train.updates={updates}",
        f"eval.every_updates={updates}",
        "eval.pass_k=0",
        f"log.output_dir={output_dir}",
        "log.progress=false",
        "log.tensorboard=false",
    ]
    smoke = (
        [
            "model.warm_start=false",
            "train.batch_size=8",
            "train.mini_batch_size=8",
            "train.micro_batch_size=8",
            "eval.max_examples=4",
        ]
        if args.smoke
        else []
    )
    return load_config(args.config, list(args.overrides) + overrides + (QUICK_OVERRIDES if args.quick else []) + smoke)


def check_comparable(config) -> None:
    """Reject settings that TRL's GRPOTrainer cannot reproduce, saying which key to change."""
    train, est = config.train, config.estimator
    problems = []
    if est.advantage not in SCALE_REWARDS:
        problems.append(f"estimator.advantage '{est.advantage}' has no TRL twin; use one of {sorted(SCALE_REWARDS)}")
    if est.loss_agg_mode not in LOSS_TYPES:
        problems.append(
            f"estimator.loss_agg_mode '{est.loss_agg_mode}' has no TRL twin; use one of {sorted(LOSS_TYPES)}"
        )
    if est.policy_loss != "ppo" or est.kl_in_reward or est.kl_estimator != "k3" or est.kl_control != "fixed":
        problems.append(
            "TRL's GRPO loss is PPO-clip plus a fixed β·k3 KL term in the loss; set "
            "estimator.policy_loss=ppo, kl_in_reward=false, kl_estimator=k3, kl_control=fixed"
        )
    if est.normalize_advantages or est.entropy_coef > 0 or est.dual_clip is not None or est.off_policy_weight != "none":
        problems.append(
            "set estimator.normalize_advantages=false, entropy_coef=0, dual_clip=null, "
            "off_policy_weight=none (TRL's GRPO has no equivalent)"
        )
    if train.mini_batch_size % train.micro_batch_size or train.batch_size % train.mini_batch_size:
        problems.append(
            f"train.micro_batch_size ({train.micro_batch_size}) must divide train.mini_batch_size "
            f"({train.mini_batch_size}), which must divide train.batch_size ({train.batch_size})"
        )
    if config.sample.stop:
        problems.append("sample.stop has no GRPOConfig field; leave it empty")
    if config.model.lora_rank or config.model.value_head or config.model.critic:
        problems.append("compare full fine-tuning without a critic: model.lora_rank=0, value_head=false, critic=null")
    if problems:
        raise SystemExit("config not comparable with TRL:\n  " + "\n  ".join(problems))


def trl_arguments(config, output_dir: str):
    """The GRPOConfig that reproduces ``config`` (see the mapping in the module docstring)."""
    from trl import GRPOConfig

    train, sample, est = config.train, config.sample, config.estimator
    steps_per_update = train.batch_size // train.mini_batch_size * train.num_epochs
    return GRPOConfig(
        output_dir=output_dir,
        seed=config.seed,
        data_seed=config.seed,
        per_device_train_batch_size=train.micro_batch_size,
        gradient_accumulation_steps=train.mini_batch_size // train.micro_batch_size,
        steps_per_generation=train.batch_size // train.micro_batch_size,
        num_generations=sample.samples_per_prompt,
        num_iterations=train.num_epochs,
        max_steps=train.updates * steps_per_update,
        max_completion_length=sample.max_new_tokens,
        temperature=sample.temperature,
        top_p=sample.top_p,
        top_k=sample.top_k or 0,
        learning_rate=train.learning_rate,
        lr_scheduler_type=train.lr_schedule,
        warmup_steps=0,
        optim="adamw_torch_fused",
        adam_epsilon=train.adam_eps,
        weight_decay=train.weight_decay,
        max_grad_norm=train.max_grad_norm or 0.0,
        beta=est.kl_coef,
        use_bias_correction_kl=False,
        epsilon=est.clip_range,
        epsilon_high=est.clip_range_high,
        loss_type=LOSS_TYPES[est.loss_agg_mode],
        scale_rewards=SCALE_REWARDS[est.advantage],
        use_cpu=config.device == "cpu",
        bf16=False,
        fp16=False,
        disable_dropout=True,
        gradient_checkpointing=config.model.gradient_checkpointing,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        report_to="none",
        save_strategy="no",
        logging_steps=steps_per_update,
        disable_tqdm=True,
        log_completions=False,
    )


def trl_dataset(task, system_prompt: str | None):
    """The task's training split as TRL wants it: a conversational ``prompt`` column plus the reward columns."""
    from datasets import Dataset

    def row(example) -> dict:
        messages = [{"role": "user", "content": example.prompt}]
        if system_prompt:
            messages.insert(0, {"role": "system", "content": system_prompt})
        return {"prompt": messages, **example.columns}

    return Dataset.from_list([row(example) for example in task.train])


class RewardTally:
    """Counts the completions TRL's reward functions score and sums their weighted rewards."""

    def __init__(self):
        self.samples, self.total = 0, 0.0

    def wrap(self, function, weight: float, *, counts: bool):
        @functools.wraps(function)
        def tallied(prompts, completions, **columns):
            rewards = function(prompts, completions, **columns)
            self.samples += len(completions) if counts else 0
            self.total += weight * sum(reward for reward in rewards if reward is not None)
            return rewards

        return tallied


def trl_rewards(spec: list[dict], tally: RewardTally) -> tuple[list, list[float]]:
    """The task's reward functions (tallied) and their weights, built by unipg's reward registry."""
    from unipg.tasks.rewards.rules import build_rewards

    functions = build_rewards(spec).functions
    wrapped = [tally.wrap(function, weight, counts=index == 0) for index, (_, function, weight) in enumerate(functions)]
    return wrapped, [weight for _, _, weight in functions]


def held_out_pass_at_1(model, tokenizer, task, config) -> float:
    """Greedy pass@1 on the held-out split, measured exactly as unipg measures its own runs."""
    from unipg.policy.lm import LMPolicy
    from unipg.runtime.lm import evaluate_lm
    from unipg.sample.episodes import EpisodeRunner
    from unipg.tasks.rewards.rules import build_rewards

    runner = EpisodeRunner(LMPolicy(model, tokenizer), task, config, build_rewards(config.task.rewards or task.rewards))
    test = task.test[: config.eval.max_examples] if config.eval.max_examples else task.test
    was_training = model.training
    model.eval()
    try:
        metrics = evaluate_lm(runner, test, pass_k=0, seed=config.seed + EVAL_SEED)
    finally:
        runner.close()
        model.train(was_training)
    return metrics["eval/pass@1"]


def run_trl(config, task, output_dir: str) -> RunResult:
    """Train the warm-started model with TRL's GRPOTrainer; time its training loop alone."""
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOTrainer

    from unipg.policy.loading import load_causal_lm, load_tokenizer

    class LoopTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_train_end(self, args, state, control, **kwargs):
            self.seconds = time.perf_counter() - self.start

    tokenizer = load_tokenizer(config.model.name)
    model = load_causal_lm(config.model.name, dtype=config.model.dtype)
    pass_before = held_out_pass_at_1(model, tokenizer, task, config)
    tally = RewardTally()
    rewards, weights = trl_rewards(config.task.rewards or task.rewards, tally)
    arguments = trl_arguments(config, output_dir)
    arguments.reward_weights = weights
    timer = LoopTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=rewards,
        args=arguments,
        train_dataset=trl_dataset(task, config.task.system_prompt or task.system_prompt),
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.remove_callback(PrinterCallback)  # its per-step log lines would drown the table
    trainer.train()
    pass_after = held_out_pass_at_1(trainer.model, tokenizer, task, config)
    return RunResult(
        "trl", config.seed, tally.samples, timer.seconds, tally.total / max(tally.samples, 1), pass_before, pass_after
    )


def run_unipg(config, task) -> RunResult:
    from unipg.observe.metrics import read_metrics
    from unipg.runtime.lm import train_lm

    result = train_lm(config, task=task)
    rewards = [
        record["rollout/reward_mean"] for record in read_metrics(result.run_dir) if "rollout/reward_mean" in record
    ]
    return RunResult(
        "unipg",
        config.seed,
        result.samples,
        result.train_seconds,
        statistics.fmean(rewards),
        result.initial_eval["eval/pass@1"],
        result.final_eval["eval/pass@1"],
    )


def print_settings(config) -> None:
    train, sample, est = config.train, config.sample, config.estimator
    print(f"task {config.task.name} {config.task.options}, model {config.model.name}")
    print(
        f"updates {train.updates} × batch {train.batch_size} (group {sample.samples_per_prompt}, mini-batch "
        f"{train.mini_batch_size}, micro-batch {train.micro_batch_size}, epochs {train.num_epochs}), max new tokens "
        f"{sample.max_new_tokens}, temperature {sample.temperature}, lr {train.learning_rate}, β {est.kl_coef}, "
        f"clip {est.clip_range}, loss {est.loss_agg_mode} (TRL '{LOSS_TYPES[est.loss_agg_mode]}'), "
        f"eval on {config.eval.max_examples or 'all'} held-out examples, {torch.get_num_threads()} threads"
    )


# (heading, width, format) of the table's numeric columns
COLUMNS = (
    ("samples", 9, "d"),
    ("train s", 10, ".1f"),
    ("samples/s", 11, ".1f"),
    ("train reward", 14, ".3f"),
    ("pass@1 before", 15, ".3f"),
    ("pass@1 after", 14, ".3f"),
)


def table_row(label: str, seed: str, values: tuple) -> str:
    """One line of the table; a None value leaves its cell blank."""
    cells = "".join(
        " " * width if value is None else f"{value:>{width}{form}}" for value, (_, width, form) in zip(values, COLUMNS)
    )
    return f"{label:<10}{seed:>5}{cells}"


def print_table(results: list[RunResult], seeds: list[int]) -> None:
    header = f"{'framework':<10}{'seed':>5}" + "".join(f"{name:>{width}}" for name, width, _ in COLUMNS)
    print("\n" + header + "\n" + "-" * len(header))
    ordered = sorted(results, key=lambda r: (seeds.index(r.seed), r.framework))
    for r in ordered:
        print(
            table_row(
                r.framework,
                str(r.seed),
                (r.samples, r.train_seconds, r.samples_per_second, r.train_reward, r.pass_before, r.pass_after),
            )
        )
    runs = {name: [r for r in ordered if r.framework == name] for name in ("trl", "unipg")}
    if len(seeds) > 1 and all(runs.values()):
        for name, mine in runs.items():
            means = [
                statistics.fmean(getattr(r, field) for r in mine)
                for field in ("samples_per_second", "train_reward", "pass_before", "pass_after")
            ]
            print(table_row(name, "mean", (None, None, *means)))
    if not all(runs.values()):  # one framework alone (--only): nothing to compare
        return
    ratios = [u.samples_per_second / t.samples_per_second for t, u in zip(runs["trl"], runs["unipg"])]
    per_seed = ", ".join(f"seed {t.seed}: {ratio:.2f}" for t, ratio in zip(runs["trl"], ratios))
    print(
        f"\nsamples/s ratio unipg / TRL: {statistics.fmean(ratios):.2f}" + (f" ({per_seed})" if len(ratios) > 1 else "")
    )


def quiet_libraries() -> None:
    """No progress bars or deprecation notices from transformers: the table is the output."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\.")
    # TRL warns about the installed vLLM's version on import; its generation here is model.generate, not vLLM
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM", category=UserWarning)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    quiet_libraries()
    if importlib.util.find_spec("trl") is None:
        raise SystemExit("TRL is not installed: pip install -e '.[test]' (or '.[bench]') brings it")
    frameworks = [args.only] if args.only else ["trl", "unipg"]
    from unipg.learn.warm_start import resolve_warm_start
    from unipg.tasks.base import make_task

    seeds = [int(seed) for seed in args.seeds.split(",")]
    results: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as output_dir:
        for position, seed in enumerate(seeds):
            config = load_benchmark_config(args, seed, output_dir)
            check_comparable(config)
            task = make_task(config.task.name, **config.task.options)
            config = resolve_warm_start(config, task)  # supervised fine-tuning on first use, then cached
            if position == 0:
                print_settings(config)
            order = frameworks if position % 2 == 0 else frameworks[::-1]
            for framework in order:
                print(f"seed {seed}: training with {framework} ...", flush=True)
                try:
                    if framework == "trl":
                        result = run_trl(config, task, os.path.join(output_dir, f"trl-seed{seed}"))
                    else:
                        result = run_unipg(config, task)
                except Exception as error:  # report what TRL (or unipg) could not do on this machine, then stop
                    raise SystemExit(f"{framework} failed on seed {seed}: {type(error).__name__}: {error}") from error
                results.append(result)
                rate, before, after = result.samples_per_second, result.pass_before, result.pass_after
                print(
                    f"  {result.samples} samples in {result.train_seconds:.1f} s ({rate:.1f}/s), "
                    f"pass@1 {before:.3f} → {after:.3f}",
                    flush=True,
                )
    print_table(results, seeds)


if __name__ == "__main__":
    main()
