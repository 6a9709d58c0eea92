"""Runs of a multi-role task with a LoRA adapter per role (``agent.role_policy: adapters``): both adapters train,
checkpoints hold both with their optimizer state, and a resumed run continues exactly."""

from pathlib import Path

import pytest
import torch

from tests.helpers.configs import tiny_team_overrides
from unipg.checkpoint.files import load_checkpoint
from unipg.checkpoint.store import CheckpointStore
from unipg.config import ConfigError, load_config
from unipg.observe.metrics import read_metrics
from unipg.runtime.lm import train_lm

pytestmark = pytest.mark.e2e
pytest.importorskip("peft")

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "solver_checker.yaml"
ROLES = ("solver", "checker")
TINY = tiny_team_overrides("model.lora_rank=4", "agent.role_policy=adapters")


def adapters_config(output_dir, name: str, updates: int, *extra: str):
    return load_config(
        CONFIG, TINY + [f"log.output_dir={output_dir}", f"log.run_name={name}", f"train.updates={updates}", *extra]
    )


def latest_tensors(run_dir) -> dict:
    return load_checkpoint(CheckpointStore(run_dir / "checkpoints").latest()).tensors


@pytest.mark.parametrize("staleness", [0, 1])
def test_both_adapters_train_and_are_saved_with_their_grad_norms(tmp_path, staleness):
    config = adapters_config(tmp_path, "team", 2, f"runtime.max_staleness={staleness}")
    result = train_lm(config, log=lambda text: None)
    steps = [record for record in read_metrics(result.run_dir) if "train/loss" in record]
    assert len(steps) == 2
    for role in ROLES:
        assert all(record[f"role/{role}/grad_norm"] > 0 for record in steps), role
        assert f"rollout/{role}/reward_mean" in steps[0]
    tensors = latest_tensors(result.run_dir)
    assert set(tensors) == {"adapter_model.solver", "adapter_model.checker", "optimizer"}
    for role in ROLES:  # LoRA's B starts at zero: a non-zero B was trained
        assert any(t.abs().sum() > 0 for name, t in tensors[f"adapter_model.{role}"].items() if "lora_B" in name)
    assert tensors["adapter_model.solver"].keys() == tensors["adapter_model.checker"].keys()
    for role in ROLES:  # the final model: PEFT's folder per adapter
        assert (result.run_dir / "policy" / role / "adapter_model.safetensors").is_file()


def test_a_resumed_adapters_run_equals_the_uninterrupted_one(tmp_path):
    full = train_lm(adapters_config(tmp_path, "full", 2), log=lambda text: None)
    first = train_lm(adapters_config(tmp_path, "split", 1), log=lambda text: None)
    resumed = train_lm(adapters_config(tmp_path, "split", 2), resume=first.run_dir, log=lambda text: None)
    assert resumed.resumed_from == 1 and resumed.samples == full.samples
    expected, got = latest_tensors(full.run_dir), latest_tensors(resumed.run_dir)
    assert expected.keys() == got.keys()
    for group in expected:
        assert expected[group].keys() == got[group].keys()
        for name in expected[group]:
            assert torch.equal(expected[group][name], got[group][name]), (group, name)


def test_adapters_need_a_multi_role_task_and_lora(tmp_path, embedded_path):
    one_role = load_config(
        None,
        [
            "task.name=arithmetic",
            "algorithm=grpo",
            f"model.name={embedded_path}",
            "model.lora_rank=4",
            "agent.role_policy=adapters",
            f"log.output_dir={tmp_path}",
            "log.progress=false",
        ],
    )
    with pytest.raises(ConfigError, match="task 'arithmetic' has one role; set agent.role_policy=shared"):
        train_lm(one_role, log=lambda text: None)
    with pytest.raises(ConfigError, match=r"set model.lora_rank \(e.g. 8\)"):
        load_config(CONFIG, [item for item in TINY if item != "model.lora_rank=4"])


def test_an_adapter_per_role_run_is_evaluated_with_each_roles_trained_adapter(tmp_path):
    from safetensors.torch import load_file

    from unipg.api import evaluate_episodes, evaluation_config
    from unipg.policy.adapters import adapter_tensors
    from unipg.runtime.evaluation import evaluated_policy

    result = train_lm(adapters_config(tmp_path, "team", 1), log=lambda text: None)
    config = evaluation_config(result.run_dir, notify=lambda text: None)
    policy = evaluated_policy(config, list(ROLES), {})
    for role in ROLES:  # the adapter `unipg eval RUN` samples a role with is the one the run saved for it
        saved = load_file(result.run_dir / "policy" / role / "adapter_model.safetensors")
        loaded = adapter_tensors(policy.model, role)
        assert saved.keys() == loaded.keys() and any(t.abs().sum() > 0 for t in saved.values())
        assert all(torch.equal(saved[name], loaded[name]) for name in saved), role
    metrics, shown = evaluate_episodes(config, show=1)
    assert "eval/pass@1" in metrics and len(shown) == 1
