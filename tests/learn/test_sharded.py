"""train.learner_processes: a run whose learner is sharded over 2 processes trains like a one-process run, and
its checkpoint resumes in one process."""

import types

import pytest
import torch

from tests.helpers.configs import CHECKPOINTED_PPO
from unipg.checkpoint.files import load_checkpoint
from unipg.checkpoint.store import CheckpointStore
from unipg.config import ConfigError, load_config
from unipg.learn.sharded import PREPARED, _gathered_optimizer_state, _run
from unipg.runtime.lm import train_lm


def config(embedded_path, output_dir, name, updates, processes):
    return load_config(
        None,
        CHECKPOINTED_PPO
        + [
            f"model.name={embedded_path}",
            f"log.output_dir={output_dir}",
            f"log.run_name={name}",
            f"train.updates={updates}",
            f"train.learner_processes={processes}",
        ],
    )


def weights(run):
    return load_checkpoint(CheckpointStore(run.run_dir / "checkpoints").latest()).tensors


@pytest.mark.e2e
def test_a_sharded_run_trains_like_one_process_and_resumes_in_one(embedded_path, tmp_path):
    single = train_lm(config(embedded_path, tmp_path, "single", 2, 1))
    sharded = train_lm(config(embedded_path, tmp_path, "sharded", 1, 2))
    resumed = train_lm(config(embedded_path, tmp_path, "sharded", 2, 1), resume=sharded.run_dir)
    assert resumed.resumed_from == 1
    expected, got = weights(single), weights(resumed)
    for group in ("policy", "value_head"):
        for name, tensor in expected[group].items():
            assert torch.allclose(got[group][name], tensor, atol=1e-5), name
    for name, tensor in expected["optimizer"].items():
        assert torch.allclose(got["optimizer"][name], tensor, atol=1e-6, rtol=1e-3), name


def test_learner_ranks_a_local_ray_instance_cannot_place_are_refused_naming_the_keys():
    with pytest.raises(ConfigError, match=r"train.learner_processes \(2\) × ray.learner_num_cpus \(1\).*ray.num_cpus"):
        load_config(None, ["task.name=arithmetic", "backend=ray", "train.learner_processes=2", "ray.num_cpus=1"])


@pytest.fixture
def copies_off_the_device(monkeypatch):
    """``Tensor.cpu`` made to copy, as it does from a GPU: the tensors it returns are recorded, so a test can tell
    what a rank moved to the CPU from what it would have sent as it was (from a GPU, a CUDA tensor)."""
    moved, cpu = set(), torch.Tensor.cpu

    def copy_to_cpu(tensor, *args, **kwargs):
        copy = cpu(tensor, *args, **kwargs).clone()
        moved.add(id(copy))
        return copy

    monkeypatch.setattr(torch.Tensor, "cpu", copy_to_cpu)
    return moved


def test_what_a_rank_sends_the_driver_is_moved_to_the_cpu(copies_off_the_device):
    def prepare(batch):
        for field in PREPARED:
            setattr(batch, field, torch.ones(2, 3))
        return {"loss": 1.0}

    metrics, fields = _run(types.SimpleNamespace(prepare=prepare), "prepare", (types.SimpleNamespace(),))
    assert metrics == {"loss": 1.0}
    assert all(id(fields[field]) in copies_off_the_device for field in PREPARED)

    parameter = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([parameter])
    parameter.grad = torch.ones(3)
    optimizer.step()
    gathered = _gathered_optimizer_state(optimizer)["state"][0]
    assert all(id(gathered[key]) in copies_off_the_device for key in ("exp_avg", "exp_avg_sq", "step"))
