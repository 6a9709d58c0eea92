import json

import pytest
from typer.testing import CliRunner

from tests.helpers.configs import TWO_EVALUATED_UPDATES as SMALL
from unipg.cli import app
from unipg.config import load_config
from unipg.learn.warm_start import MARKER, resolve_warm_start
from unipg.observe.metrics import read_metrics
from unipg.policy.loading import load_lm_policy
from unipg.runtime.lm import train_lm
from unipg.tasks.base import make_task


@pytest.mark.e2e
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_training_run_logs_the_step_metrics_and_saves_the_policy(embedded_path, tmp_path, algorithm):
    config = load_config(
        None,
        SMALL
        + [
            f"algorithm={algorithm}",
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
            "estimator.kl_coef=0.05",
        ],
    )
    result = train_lm(config)
    assert result.updates == 2 and result.samples == 16 and result.samples_per_second > 0
    assert set(result.final_eval) == {
        "eval/pass@1",
        "eval/pass@2",
        "eval/sampled_completion",
        "eval/response_length",
        "eval/turns",
        "eval/truncated_fraction",
        "val/pass@1",  # greedy on the validation split, which ranks checkpoints
        "val/response_length",
        "val/turns",
        "val/truncated_fraction",
    }
    assert not any(key.startswith("val/") for key in result.initial_eval)  # before training nothing is decided
    assert result.final_eval["eval/sampled_completion"] <= result.final_eval["eval/pass@2"]
    records = read_metrics(result.run_dir)
    train_record = next(r for r in records if "rollout/reward_mean" in r)
    for key in [
        "rollout/reward_std",
        "rollout/response_length",
        "train/kl_to_reference",
        "train/clip_fraction",
        "train/approx_kl",
        "train/entropy",
        "train/advantage_mean",
        "train/advantage_std",
        "train/grad_norm",
        "train/learning_rate",
        "timing/generate",
        "timing/env",
        "timing/logprob",
        "timing/update",
        "timing/tokens_per_second",
        "timing/samples_per_second",
    ]:
        assert key in train_record, key
    if algorithm == "ppo":
        assert "train/value_loss" in train_record and "train/explained_variance" in train_record
    policy = load_lm_policy(str(result.run_dir / "policy"), value_head=algorithm == "ppo")
    assert policy.model.config.vocab_size > 0


def test_warm_start_is_built_once_and_reused(embedded_path, tmp_path):
    config = load_config(None, SMALL + ["model.warm_start=true", "sft.steps=3", "sft.batch_size=4"])
    task = make_task("arithmetic", digits=1, num_train=40, num_test=8)
    messages = []
    first = resolve_warm_start(config, task, root=tmp_path, log=messages.append)
    folder = first.model.name
    assert json.loads(open(f"{folder}/{MARKER}").read())["task"] == "arithmetic"
    assert "CPU thread" in messages[0]  # the count it fine-tunes on, which a busy machine may want lowered
    second = resolve_warm_start(config, task, root=tmp_path, log=messages.append)
    assert second.model.name == folder and len(messages) == 1  # the second call found the cache
    other = load_config(None, SMALL + ["model.warm_start=true", "sft.steps=4", "sft.batch_size=4"])
    assert resolve_warm_start(other, task, root=tmp_path, log=messages.append).model.name != folder


def test_the_warm_start_fine_tunes_on_every_core_and_gives_the_run_its_one_thread_back(
    embedded_path, tmp_path, monkeypatch
):
    import torch

    import unipg.learn.warm_start as sft_job
    from unipg.config.devices import cpu_threads

    seen = []
    monkeypatch.setattr(
        sft_job, "fine_tune_on_demonstrations", lambda *args, **kwargs: seen.append(torch.get_num_threads()) or {}
    )
    monkeypatch.setattr(sft_job, "STARTUP_THREADS", 3)
    task = make_task("arithmetic", digits=1, num_train=40, num_test=8)
    with cpu_threads(1):  # as a run of the embedded model sets it
        for overrides, folder in [([], "a"), (["threads=2"], "b"), (["deterministic=true"], "c")]:
            config = load_config(None, SMALL + ["model.warm_start=true", "sft.steps=3"] + overrides)
            sft_job.build_warm_start(config, task, tmp_path / folder, log=lambda text: None)
            assert torch.get_num_threads() == 1
    assert seen == [3, 2, 1]


def test_a_tools_simulated_latency_or_injected_faults_do_not_change_the_warm_start():
    from unipg.learn.warm_start import warm_start_folder

    plain = load_config(None, SMALL + ["task.tools=[{name: calculator}]"])
    slow = load_config(None, SMALL + ["task.tools=[{name: calculator, latency: {kind: fixed, seconds: 1}}]"])
    faulty = load_config(None, SMALL + ["task.tools=[{name: faulty, options: {tool: calculator, raise_rate: 0.1}}]"])
    other = load_config(None, SMALL + ["task.tools=[{name: search}]"])
    assert warm_start_folder(plain) == warm_start_folder(slow) == warm_start_folder(faulty) != warm_start_folder(other)


def test_sft_stages_run_in_order_each_on_the_task_built_with_its_options(embedded_path, monkeypatch):
    import unipg.learn.warm_start as sft_job

    config = load_config(
        None,
        [
            "task.name=calculator",
            "task.options={digits: 2, num_train: 40, num_test: 4, tool_demonstrations: 0.0}",
            "sft.stages=[{steps: 2, options: {tool_demonstrations: 1.0}, learning_rate: 0.01, batch_size: 4}]",
            "sft.steps=3",
        ],
    )
    seen = []
    monkeypatch.setattr(sft_job, "sft_train", lambda model, tokenizer, pairs, **kw: seen.append((pairs, kw)) or {})
    policy = load_lm_policy(embedded_path)
    task = make_task("calculator", digits=2, num_train=40, num_test=4, tool_demonstrations=0.0)
    sft_job.fine_tune_on_demonstrations(policy.model, policy.tokenizer, task, config, seed=0, log_every=1)
    (first, first_kw), (main, main_kw) = seen
    assert all(len(completion) == 3 for _, completion in first)  # every demonstration calls the calculator
    assert all(isinstance(completion, str) or len(completion) == 1 for _, completion in main)
    assert (first_kw["steps"], first_kw["learning_rate"], first_kw["batch_size"]) == (2, 0.01, 4)
    assert (main_kw["steps"], main_kw["learning_rate"], main_kw["batch_size"]) == (
        3,
        config.sft.learning_rate,
        config.sft.batch_size,
    )


@pytest.mark.e2e
def test_deterministic_agent_runs_with_the_same_seed_log_identical_metrics(embedded_path, tmp_path):
    """Tool-calling episodes included: deterministic mode batches generation in a fixed order."""
    runs = []
    for name in ("a", "b"):
        config = load_config(
            None,
            SMALL
            + [
                "task.name=calculator",
                "task.options={digits: 2, num_train: 40, num_test: 8, tool_demonstrations: 1.0}",
                "sample.max_new_tokens=8",
                "agent.max_total_tokens=40",
                "deterministic=true",
                f"model.name={embedded_path}",
                f"log.output_dir={tmp_path}",
                f"log.run_name={name}",
            ],
        )
        records = read_metrics(train_lm(config).run_dir)
        runs.append(
            [
                {
                    key: value
                    for key, value in record.items()
                    if not key.startswith(("timing/", "system/")) and key != "time" and not key.endswith("tool_seconds")
                }
                for record in records
            ]
        )
    assert len(runs[0]) == 3 and json.dumps(runs[0]) == json.dumps(runs[1])


@pytest.mark.e2e
def test_cli_trains_a_text_task_and_reports_before_and_after(embedded_path, tmp_path):
    result = CliRunner().invoke(
        app,
        [
            "train",
            *SMALL,
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
            "algorithm=rloo",
            "train.updates=1",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "greedy" in result.output and "→" in result.output


def test_cli_bad_model_path_is_a_clear_error(tmp_path):
    result = CliRunner().invoke(app, ["train", *SMALL, f"model.name={tmp_path}/missing", f"log.output_dir={tmp_path}"])
    assert result.exit_code == 2
    output = " ".join(result.output.split())  # the console wraps long lines
    assert "not found" in output and "save_pretrained" in output and "Traceback" not in output


def test_cli_sft_saves_a_loadable_model(embedded_path, tmp_path):
    result = CliRunner().invoke(
        app,
        [
            "sft",
            *SMALL,
            f"model.name={embedded_path}",
            "sft.steps=3",
            "sft.batch_size=4",
            "--output",
            str(tmp_path / "sft"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "held-out greedy accuracy" in result.output
    load_lm_policy(str(tmp_path / "sft"))


def test_cli_unknown_task_or_reward_names_the_valid_ones(tmp_path):
    for override, expected in [("task.name=arithmetc", "arithmetic"), ("task.rewards=[{name: mth}]", "math")]:
        args = [a for a in SMALL if not (override.startswith("task.name") and a.startswith("task."))]
        result = CliRunner().invoke(app, ["train", *args, override, f"log.output_dir={tmp_path}"])
        output = " ".join(result.output.split())
        assert result.exit_code == 2, result.output
        assert "did you mean" in output and expected in output and "Traceback" not in output


@pytest.mark.e2e
def test_a_run_with_tis_on_logs_the_engine_gap_every_update(embedded_path, tmp_path):
    config = load_config(
        None,
        SMALL
        + [
            "algorithm=grpo",
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
            "train.tis=on",
            "eval.pass_k=0",
        ],
    )
    records = [r for r in read_metrics(train_lm(config).run_dir) if "rollout/reward_mean" in r]
    assert len(records) == 2
    for record in records:
        assert record["mismatch/tokens"] > 0 and record["mismatch/fraction_capped"] == 0.0
        # the hf engine is the trainer's own model: only float rounding between its two forward passes
        assert 0.0 <= record["mismatch/k3"] < 1e-6 and record["mismatch/max_ratio"] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.e2e
def test_a_bfloat16_run_trains_and_saves_a_bfloat16_policy(embedded_path, tmp_path):
    import torch

    config = load_config(
        None,
        SMALL
        + [
            "algorithm=ppo",
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path}",
            "dtype=bfloat16",
            "device=auto",
            "eval.pass_k=0",
            "train.learning_rate=1e-3",
            "task.rewards=[{name: length, max_length: 3}]",
        ],
    )  # rewards that vary
    result = train_lm(config)
    records = [r for r in read_metrics(result.run_dir) if "rollout/reward_mean" in r]
    assert len(records) == 2 and all(r["train/grad_norm"] > 0 and r["train/loss"] == r["train/loss"] for r in records)
    policy = load_lm_policy(str(result.run_dir / "policy"), dtype="bfloat16", value_head=True)
    assert {p.dtype for p in policy.model.parameters()} == {torch.bfloat16}
    assert policy.value_head.linear.weight.dtype == torch.float32  # value heads stay float32
