"""Runs of a multi-role task with a model per role (``agent.role_policy: separate``): two models of different sizes
train in one run, each only from its own role's rows, synchronously and with staleness; checkpoints hold both with
their optimizer state, and a resumed run continues exactly."""

from pathlib import Path

import pytest
import torch

from tests.helpers.configs import tiny_team_overrides
from unipg.api import evaluate_episodes
from unipg.checkpoint.files import load_checkpoint
from unipg.checkpoint.store import CheckpointStore
from unipg.config import load_config
from unipg.observe.metrics import read_metrics
from unipg.policy.loading import load_causal_lm
from unipg.runtime.evaluation import run_config
from unipg.runtime.lm import train_lm

pytestmark = pytest.mark.e2e

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "solver_checker.yaml"
ROLES = ("solver", "checker")
TINY = tiny_team_overrides("agent.role_policy=separate")


def tiny_llama(folder: Path, hidden_size: int, seed: int) -> str:
    """A randomly initialised llama-style model of ``hidden_size`` with the embedded character tokenizer, saved to
    ``folder`` (no download: the roles' models of different sizes are built here)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from unipg.policy.embedded import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def role_models(tmp_path_factory) -> dict[str, str]:
    """A larger solver (hidden 64) and a smaller checker (hidden 32)."""
    root = tmp_path_factory.mktemp("role-models")
    return {"solver": tiny_llama(root / "solver", 64, seed=1), "checker": tiny_llama(root / "checker", 32, seed=2)}


def separate_config(models: dict[str, str], output_dir, name: str, updates: int, *extra: str):
    return load_config(
        CONFIG,
        TINY
        + [
            f"model.name={models['solver']}",  # the solver's: a role not named in agent.roles plays the run's model
            f"agent.roles.checker.model={models['checker']}",
            f"log.output_dir={output_dir}",
            f"log.run_name={name}",
            f"train.updates={updates}",
            *extra,
        ],
    )


def latest_tensors(run_dir) -> dict:
    return load_checkpoint(CheckpointStore(run_dir / "checkpoints").latest()).tensors


@pytest.mark.parametrize("staleness", [0, 1])
def test_two_models_of_different_sizes_train_in_one_run(tmp_path, role_models, staleness):
    config = separate_config(role_models, tmp_path, "team", 2, f"runtime.max_staleness={staleness}")
    result = train_lm(config, log=lambda text: None)
    steps = [record for record in read_metrics(result.run_dir) if "train/loss" in record]
    assert len(steps) == 2
    for role in ROLES:
        for metric in ("grad_norm", "entropy", "reward_mean", "loss"):
            assert f"role/{role}/{metric}" in steps[0], (role, metric)
        assert all(record[f"role/{role}/grad_norm"] > 0 for record in steps), role
    if staleness:
        assert "role/solver/staleness_mean" in steps[-1]
    tensors = latest_tensors(result.run_dir)
    assert {"policy", "optimizer"} <= set(tensors)
    for role in ROLES:  # each role's model was trained away from its initial weights, and saved whole
        initial = load_causal_lm(role_models[role]).state_dict()
        trained = {name.removeprefix(f"{role}."): t for name, t in tensors["policy"].items() if name.startswith(role)}
        assert trained.keys() == initial.keys()
        assert any(not torch.equal(trained[name], initial[name]) for name in initial), role
        assert any(name.startswith(f"{role}.state.") for name in tensors["optimizer"]), role
        assert (result.run_dir / "policy" / role / "config.json").is_file()
    hidden = {role: tensors["policy"][f"{role}.model.embed_tokens.weight"].shape[1] for role in ROLES}
    assert hidden == {"solver": 64, "checker": 32}
    evaluated = run_config(
        result.run_dir, [], notify=lambda text: None
    )  # `unipg eval RUN` reads each role's saved model
    assert {role: evaluated.agent.roles[role].model for role in ROLES} == {
        role: str(result.run_dir / "policy" / role) for role in ROLES
    }
    metrics, shown = evaluate_episodes(evaluated, show=1)
    assert "eval/pass@1" in metrics and len(shown) == 1


def test_a_resumed_two_model_run_equals_the_uninterrupted_one(tmp_path, role_models):
    full = train_lm(separate_config(role_models, tmp_path, "full", 2), log=lambda text: None)
    first = train_lm(separate_config(role_models, tmp_path, "split", 1), log=lambda text: None)
    resumed = train_lm(separate_config(role_models, tmp_path, "split", 2), resume=first.run_dir, log=lambda t: None)
    assert resumed.resumed_from == 1 and resumed.samples == full.samples
    expected, got = latest_tensors(full.run_dir), latest_tensors(resumed.run_dir)
    assert expected.keys() == got.keys()
    for group in expected:
        assert expected[group].keys() == got[group].keys()
        for name in expected[group]:
            assert torch.equal(expected[group][name], got[group][name]), (group, name)
    metrics = lambda run_dir: [r for r in read_metrics(run_dir) if r["step"] == 2 and "train/loss" in r][0]
    full_record, resumed_record = metrics(full.run_dir), metrics(resumed.run_dir)
    for role in ROLES:
        for name in ("loss", "grad_norm", "reward_mean"):
            key = f"role/{role}/{name}"
            assert full_record[key] == resumed_record[key], key
