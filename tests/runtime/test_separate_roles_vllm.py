"""A model per role (``agent.role_policy: separate``) on the vllm engine, for real (vLLM on CPU): one engine per
role's model in one process, each request sampled by its role's engine, each role's weights loaded into its own
engine by version, with the sequential schedule and the concurrent one, in this process and on a Ray rollout worker.

Each run has a spawned process of its own: the suite's other vLLM engines (tests/inference) live on in the test
process, and a process holds engines of one run only."""

import math
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from tests.helpers.configs import tiny_team_overrides
from tests.runtime.test_separate_roles_run import CONFIG, ROLES, latest_tensors, tiny_llama
from unipg.config import load_config
from unipg.observe.metrics import read_metrics
from unipg.policy.loading import load_causal_lm
from unipg.runtime.lm import train_lm

pytest.importorskip("vllm")
pytestmark = pytest.mark.e2e


def train_two_models(tmp_path, *changes: str) -> tuple[list[dict], dict[str, bool]]:
    """The two-role run on vllm (two updates unless ``changes`` say otherwise): the metrics of its training steps,
    and per role whether its saved weights differ from its initial ones."""
    models = {
        "solver": tiny_llama(tmp_path / "solver", 128, seed=1),
        "checker": tiny_llama(tmp_path / "checker", 64, 2),
    }
    overrides = tiny_team_overrides(
        "agent.role_policy=separate",
        f"model.name={models['solver']}",
        f"agent.roles.checker.model={models['checker']}",
        f"log.output_dir={tmp_path}",
        "train.updates=2",
        "sample.engine=vllm",
        *changes,
    )
    result = train_lm(load_config(CONFIG, overrides), log=lambda text: None)
    policy = latest_tensors(result.run_dir)["policy"]
    moved = {}
    for role in ROLES:
        initial = load_causal_lm(models[role]).state_dict()
        moved[role] = any(not torch.equal(policy[f"{role}.{name}"], tensor) for name, tensor in initial.items())
    return [record for record in read_metrics(result.run_dir) if "train/loss" in record], moved


def train_in_own_process(tmp_path, *changes: str) -> tuple[list[dict], dict[str, bool]]:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(train_two_models, tmp_path, *changes).result()


def test_two_models_of_different_sizes_train_on_the_vllm_engine(tmp_path):
    """vLLM's CPU attention needs a head size of at least 32: hidden sizes 128 and 64 with two heads."""
    steps, moved = train_in_own_process(tmp_path, "runtime.max_staleness=0")
    assert len(steps) == 2
    assert moved == dict.fromkeys(ROLES, True)
    for role in ROLES:
        assert all(record[f"role/{role}/grad_norm"] > 0 for record in steps), role
        # the engine's log-probs are the trainer's for the role's model: each role's turns were sampled by its own
        assert all(record[f"role/{role}/mismatch/k3"] < 1e-4 for record in steps), role
    assert steps[-1]["engine/weight_syncs"] == 2  # version 1 loaded into each role's engine


# three updates at η = 1: the third trains on rows sampled by version 1 or later, so each role's engine must have
# loaded its role's newer weights (a turn carries the version its engine held)
CONCURRENT = ("runtime.max_staleness=1", "runtime.schedule=concurrent", "train.updates=3")


def assert_both_roles_trained_concurrently(steps: list[dict], moved: dict[str, bool]) -> None:
    assert len(steps) == 3
    assert moved == dict.fromkeys(ROLES, True)
    for role in ROLES:
        assert all(math.isfinite(record[f"role/{role}/loss"]) for record in steps), role
        assert all(record[f"role/{role}/grad_norm"] > 0 for record in steps), role
        # the engines' log-probs are the trainer's on every row of the learner's version: all of the first update's
        # (version 0), a later update's where the rollout had caught up with the learner
        assert f"role/{role}/mismatch/k3" in steps[0], role
        assert all(record.get(f"role/{role}/mismatch/k3", 0.0) < 1e-4 for record in steps), role
    assert all(record["async/staleness_token_max"] <= 1 for record in steps)


def test_two_models_train_on_the_vllm_engine_with_the_concurrent_schedule(tmp_path):
    """The rollout samples from both roles' engines while the learner steps; each role's engine pulls its role's
    newer weights. Engines of one process that stepped at once gave NaN log-probs here (``vllm_core``: they take
    turns)."""
    assert_both_roles_trained_concurrently(*train_in_own_process(tmp_path, *CONCURRENT))


def train_on_ray(tmp_path, *changes: str) -> tuple[list[dict], dict[str, bool]]:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        return train_two_models(tmp_path, "backend=ray", "ray.rollout_workers=1", *changes)
    finally:
        ray.shutdown()


def test_two_models_train_on_a_vllm_rollout_worker_with_the_concurrent_schedule(tmp_path):
    """On Ray the rollout worker starts an engine per role's model and loads each role's weights of a published
    version into its role's engine."""
    pytest.importorskip("ray")
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        run = pool.submit(train_on_ray, tmp_path, "sample.cpu_kv_cache_gb=0.125", *CONCURRENT)
        assert_both_roles_trained_concurrently(*run.result())
