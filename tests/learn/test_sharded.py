"""train.learner_processes: a run whose learner is sharded over 2 processes trains like a one-process run; its
checkpoints are sharded (each rank writes its own shards) and resume with 2 processes and with 1, and a
one-process checkpoint resumes on 2."""

import shutil
import types

import pytest
import torch

from tests.helpers.configs import CHECKPOINTED_PPO
from unipg.checkpoint.files import load_checkpoint, read_manifest
from unipg.checkpoint.shards import WEIGHTS_PREFIX, consolidated_tensors
from unipg.checkpoint.store import CheckpointStore
from unipg.config import ConfigError, load_config
from unipg.learn.distributed import read_shard_index
from unipg.learn.sharded import PREPARED, _run
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


def latest(run_dir):
    return load_checkpoint(CheckpointStore(run_dir / "checkpoints").latest())


def weights(checkpoint) -> dict[str, torch.Tensor]:
    """A checkpoint's policy weights by their names in ``LMPolicy`` (``model.…``, ``value_head.…``), whatever its
    format."""
    if checkpoint.sharded:
        tensors = consolidated_tensors(checkpoint.path)
        return {name.removeprefix(WEIGHTS_PREFIX): t for name, t in tensors.items() if name.startswith(WEIGHTS_PREFIX)}
    groups = {"model": checkpoint.tensors["policy"], "value_head": checkpoint.tensors["value_head"]}
    return {f"{group}.{name}": tensor for group, tensors in groups.items() for name, tensor in tensors.items()}


@pytest.fixture(scope="module")
def runs(embedded_path, tmp_path_factory):
    """One-process runs of 3 updates, uninterrupted, and of 1, resumed on 2 ranks for the 2nd update (a sharded
    checkpoint), whose folder is copied and resumed for the 3rd on 2 ranks and on 1."""
    out = tmp_path_factory.mktemp("sharded-runs")
    uninterrupted = train_lm(config(embedded_path, out, "uninterrupted", 3, 1)).run_dir
    interrupted = train_lm(config(embedded_path, out, "interrupted", 1, 1)).run_dir
    train_lm(config(embedded_path, out, "interrupted", 2, 2), resume=interrupted)
    copy = out / "copy"
    shutil.copytree(interrupted, copy)
    on_two = train_lm(config(embedded_path, out, "interrupted", 3, 2), resume=interrupted)
    on_one = train_lm(config(embedded_path, out, "copy", 3, 1), resume=copy)
    return types.SimpleNamespace(uninterrupted=uninterrupted, on_two=on_two, on_one=on_one)


@pytest.mark.e2e
def test_sharded_checkpoints_resume_on_two_ranks_and_on_one_like_an_uninterrupted_run(runs):
    assert runs.on_two.resumed_from == runs.on_one.resumed_from == 2
    expected = latest(runs.uninterrupted)
    sharded, single = latest(runs.on_two.run_dir), latest(runs.on_one.run_dir)
    assert sharded.sharded and read_manifest(sharded.path)["format_version"] == 2 and not sharded.tensors
    assert not single.sharded and read_manifest(single.path)["format_version"] == 1  # one process: safetensors
    assert sharded.step == single.step == expected.step == 3
    expected_weights = weights(expected)
    for got in (weights(sharded), weights(single)):
        assert set(got) == set(expected_weights)
        for name, tensor in got.items():
            assert torch.allclose(tensor, expected_weights[name], atol=1e-5), name
    for name, tensor in expected.tensors["optimizer"].items():
        assert torch.allclose(single.tensors["optimizer"][name], tensor, atol=1e-6, rtol=1e-3), name


@pytest.mark.e2e
def test_each_rank_writes_only_its_own_shard_of_every_tensor(runs):
    path = latest(runs.on_two.run_dir).path
    index = read_shard_index(path)
    files_of = {}  # tensor → the files that hold its chunks
    for where, stored in index.storage_data.items():
        files_of.setdefault(where.fqn, set()).add(stored.relative_path)
    embedding = "model.model.model.embed_tokens.weight"
    moment = "optimizer.state.model.model.embed_tokens.weight.exp_avg_sq"
    for name in (embedding, moment):
        chunks = index.state_dict_metadata[name].chunks
        assert len(chunks) == 2 and sum(chunk.sizes[0] for chunk in chunks) == index.state_dict_metadata[name].size[0]
        assert files_of[name] == {"__0_0.distcp", "__1_0.distcp"}, name  # half each, no rank the whole
    trained = {name.removeprefix("optimizer.state.").rsplit(".", 1)[0] for name in files_of if ".state." in name}
    tensors = [
        name for name in files_of if name.startswith("optimizer.state.") or name in {f"model.{w}" for w in trained}
    ]
    rows = {name: index.state_dict_metadata[name].size for name in tensors}
    whole = [name for name in tensors if len(files_of[name]) == 1 and len(rows[name]) and rows[name][0] > 1]
    assert whole == []
    assert {file.name for file in path.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}


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
