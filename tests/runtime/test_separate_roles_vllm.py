"""A model per role (``agent.role_policy: separate``) on the vllm engine, for real (vLLM on CPU): one engine per
role's model in one process, each request sampled by its role's engine, each role's weights loaded into its own
engine by version.

The run has a spawned process of its own: the suite's other vLLM engines (tests/inference) live on in the test
process, and a process holds engines of one run only."""

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

from tests.helpers.configs import tiny_team_overrides
from tests.runtime.test_separate_roles_run import CONFIG, ROLES, tiny_llama
from unipg.config import load_config
from unipg.observe.metrics import read_metrics
from unipg.runtime.lm import train_lm

pytest.importorskip("vllm")
pytestmark = pytest.mark.e2e


def train_two_models(tmp_path) -> list[dict]:
    """Two updates of the two-role run on vllm; the metrics of its training steps."""
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
        "runtime.max_staleness=0",
        "sample.engine=vllm",
    )
    result = train_lm(load_config(CONFIG, overrides), log=lambda text: None)
    return [record for record in read_metrics(result.run_dir) if "train/loss" in record]


def test_two_models_of_different_sizes_train_on_the_vllm_engine(tmp_path):
    """vLLM's CPU attention needs a head size of at least 32: hidden sizes 128 and 64 with two heads."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        steps = pool.submit(train_two_models, tmp_path).result()
    assert len(steps) == 2
    for role in ROLES:
        assert all(record[f"role/{role}/grad_norm"] > 0 for record in steps), role
        # the engine's log-probs are the trainer's for the role's model: each role's turns were sampled by its own
        assert all(record[f"role/{role}/mismatch/k3"] < 1e-4 for record in steps), role
    assert steps[-1]["engine/weight_syncs"] == 2  # version 1 loaded into each role's engine
