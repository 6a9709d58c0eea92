"""Sharded checkpoints in the store: the ranks' files written into the save's temporary folder are checksummed
and published with it, a failed shard write publishes nothing, a damaged or crafted index is refused, and the
checkpoint reads back whole in one process. One process writes the shards here (DCP without a process group);
tests/learn/test_sharded.py writes them from 2 ranks."""

import json
import os
import pickle
import types
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from unipg.checkpoint.files import MANIFEST_FILE, load_checkpoint, read_manifest, verify_checkpoint
from unipg.checkpoint.lm import LMCheckpointer
from unipg.checkpoint.shards import consolidated_tensors, weight_shapes
from unipg.checkpoint.store import CheckpointStore
from unipg.config.lm import CheckpointConfig
from unipg.learn.distributed import SHARD_INDEX, load_sharded, read_shard_index, read_shards, save_sharded
from unipg.learn.precision import Float32Masters


def trained(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, torch.optim.Optimizer, Float32Masters]:
    """A small model after one AdamW step, its low-precision weights stepped through float32 masters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).to(dtype)
    model[1].bias.requires_grad_(False)  # frozen: left out of the shards
    masters = Float32Masters([p for p in model.parameters() if p.requires_grad])
    optimizer = torch.optim.AdamW(masters.optimized([p for p in model.parameters() if p.requires_grad]), lr=0.1)
    model(torch.randn(5, 4, dtype=dtype)).sum().backward()
    masters.move_gradients()
    optimizer.step()
    masters.copy_to_model()
    return model, optimizer, masters


def saved(root, model, optimizer, masters, step=1):
    return CheckpointStore(root).save(
        step, {}, {"step": step, "learner": {}}, shards=lambda folder: save_sharded(folder, model, optimizer, masters)
    )


def test_a_sharded_save_is_published_with_every_file_checksummed_and_reads_back_whole(tmp_path):
    model, optimizer, masters = trained(torch.bfloat16)
    path = saved(tmp_path, model, optimizer, masters)
    manifest = verify_checkpoint(path)
    assert manifest["format_version"] == 2 and manifest["sharded"] and manifest["tensor_groups"] == {}
    assert {SHARD_INDEX, "__0_0.distcp", "state.json"} <= set(manifest["files"])
    checkpoint = load_checkpoint(path)
    assert checkpoint.sharded and checkpoint.tensors == {} and checkpoint.state == {"step": 1, "learner": {}}
    assert not [entry for entry in tmp_path.iterdir() if entry.name.startswith(".tmp-")]

    whole = consolidated_tensors(path)
    assert set(weight_shapes(path)) == {"0.weight", "0.bias", "1.weight"}  # 1.bias is frozen
    assert torch.equal(whole["model.0.weight"], model[0].weight.detach())
    master = masters.optimized([model[0].weight])[0]
    assert whole["masters.0.weight"].dtype == torch.float32 and torch.equal(whole["masters.0.weight"], master)
    assert torch.equal(whole["optimizer.state.0.weight.exp_avg"], optimizer.state[master]["exp_avg"])


def test_shards_load_into_a_fresh_learner_that_then_steps_like_the_saved_one(tmp_path):
    model, optimizer, masters = trained(torch.bfloat16)
    path = saved(tmp_path, model, optimizer, masters)
    torch.manual_seed(1)
    fresh = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).to(torch.bfloat16)
    fresh[1].bias.requires_grad_(False)
    fresh_masters = Float32Masters([p for p in fresh.parameters() if p.requires_grad])
    fresh_optimizer = torch.optim.AdamW(fresh_masters.optimized([p for p in fresh.parameters() if p.requires_grad]))
    load_sharded(path, fresh, fresh_optimizer, fresh_masters)
    for (weight, master), (twin, twin_master) in zip(masters.pairs, fresh_masters.pairs):
        assert torch.equal(twin, weight) and torch.equal(twin_master, master)
    assert fresh_optimizer.param_groups[0]["lr"] == 0.1  # the saved hyperparameters
    inputs = torch.randn(5, 4, dtype=torch.bfloat16)
    for net, opt, mast in ((model, optimizer, masters), (fresh, fresh_optimizer, fresh_masters)):
        net(inputs).sum().backward()
        mast.move_gradients()
        opt.step()
        mast.copy_to_model()
    for (_, master), (_, twin_master) in zip(masters.pairs, fresh_masters.pairs):
        assert torch.equal(twin_master, master)


def test_a_shard_write_that_fails_publishes_nothing_and_keeps_the_previous_checkpoint(tmp_path):
    model, optimizer, masters = trained()
    first = saved(tmp_path, model, optimizer, masters, step=1)

    def fails(folder):
        save_sharded(folder, model, optimizer, masters)
        raise RuntimeError("a rank ended")

    with pytest.raises(RuntimeError, match="a rank ended"):
        CheckpointStore(tmp_path).save(2, {}, {"step": 2}, shards=fails)
    assert CheckpointStore(tmp_path).list() == [first] and CheckpointStore(tmp_path).latest() == first
    assert not [entry for entry in tmp_path.iterdir() if entry.name.startswith(".tmp-")]


def test_an_index_naming_a_file_the_manifest_does_not_checksum_is_refused(tmp_path):
    model, optimizer, masters = trained()
    path = saved(tmp_path, model, optimizer, masters)
    manifest = read_manifest(path)
    del manifest["files"]["__0_0.distcp"]
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"corrupted.*names __0_0.distcp, which the manifest does not list"):
        load_checkpoint(path)


class MakesAFolder:
    """Unpickled, it makes a folder: a stand-in for code a crafted file would run."""

    def __init__(self, folder):
        self.folder = str(folder)

    def __reduce__(self):
        return (os.mkdir, (self.folder,))


def test_a_crafted_index_is_refused_without_running_its_code(tmp_path):
    (tmp_path / SHARD_INDEX).write_bytes(pickle.dumps(MakesAFolder(tmp_path / "ran")))
    with pytest.raises(pickle.UnpicklingError, match=r"names (posix|nt)\.mkdir"):
        read_shard_index(tmp_path)
    assert not (tmp_path / "ran").exists()


def test_a_crafted_value_among_the_shards_is_refused_without_running_its_code(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # saving without a process group
        dcp.save({"lr": MakesAFolder(tmp_path / "ran")}, storage_writer=dcp.FileSystemWriter(tmp_path / "shards"))
    with pytest.raises(
        RuntimeError,
        match=r"loading the shards in .* failed on rank 0: UnpicklingError: the shards' value lr is not plain data \(.*GLOBAL (posix|nt)\.mkdir",
    ):
        read_shards({"lr": 0.1}, tmp_path / "shards")
    assert not (tmp_path / "ran").exists()


def test_a_sharded_checkpoint_of_another_model_is_refused_naming_the_first_differing_tensor(tmp_path, tiny_policy):
    source = tiny_policy(value_head=True)
    parameters = [p for p in source.parameters() if p.requires_grad]
    path = saved(tmp_path, source, torch.optim.AdamW(parameters), Float32Masters(parameters))
    settings = CheckpointConfig()
    checkpointer = LMCheckpointer(
        tmp_path / "run", settings, "tiny", tiny_policy(), types.SimpleNamespace(), None, torch.Generator()
    )
    with pytest.raises(ValueError, match=r"does not fit the configured model.*value_head\.linear\.weight"):
        checkpointer.restore(load_checkpoint(path))
