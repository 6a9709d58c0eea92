import json
import os
import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

from unipg.checkpoint.files import load_checkpoint
from unipg.checkpoint.store import CheckpointStore
from unipg.learn.state import (
    generator_state,
    load_optimizer,
    optimizer_tensors,
    restore_generator,
    restore_rng,
    rng_state,
)


def small_group(value: float = 1.0) -> dict[str, dict[str, torch.Tensor]]:
    return {"policy": {"w": torch.full((3, 2), value), "b": torch.arange(3.0)}}


def test_round_trip_of_tensors_state_and_random_generators(tmp_path):
    generator = torch.Generator().manual_seed(7)
    torch.rand(3), random.random(), np.random.rand(), torch.rand(2, generator=generator)  # move off the seeds
    tensors = {
        "policy": {
            "w": torch.randn(4, 3).t(),  # non-contiguous
            "half": torch.randn(5).to(torch.bfloat16),
            "scalar": torch.tensor(3.0),
        },
        "value_head": {"bias": torch.zeros(1)},
    }
    state = {
        "step": 5,
        "policy_version": 4,
        "kl_coef": 0.05,
        "data_position": 17,
        "rng": rng_state(),
        "generator": generator_state(generator),
    }
    path = CheckpointStore(tmp_path).save(5, tensors, state, metrics={"reward": 0.5})
    expected = (torch.rand(4), random.random(), np.random.rand(3), torch.randn(2, generator=generator))

    checkpoint = load_checkpoint(path)
    restore_rng(checkpoint.state["rng"])
    restored = restore_generator(torch.Generator(), checkpoint.state["generator"])
    drawn = (torch.rand(4), random.random(), np.random.rand(3), torch.randn(2, generator=restored))

    assert torch.equal(drawn[0], expected[0]) and drawn[1] == expected[1]
    assert np.array_equal(drawn[2], expected[2]) and torch.equal(drawn[3], expected[3])
    assert checkpoint.step == 5 and checkpoint.metrics == {"reward": 0.5}
    assert {key: checkpoint.state[key] for key in ("step", "policy_version", "kl_coef", "data_position")} == {
        "step": 5,
        "policy_version": 4,
        "kl_coef": 0.05,
        "data_position": 17,
    }
    for group, group_tensors in tensors.items():
        for name, tensor in group_tensors.items():
            loaded = checkpoint.tensors[group][name]
            assert torch.equal(loaded, tensor) and loaded.dtype == tensor.dtype
    assert path == tmp_path / "step-00000005"
    assert sorted(p.name for p in path.iterdir()) == [
        "manifest.json",
        "policy.safetensors",
        "state.json",
        "value_head.safetensors",
    ]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format_version"] == 1 and manifest["step"] == 5
    assert set(manifest["files"]) == {"policy.safetensors", "state.json", "value_head.safetensors"}
    assert all(len(entry["sha256"]) == 64 and entry["bytes"] > 0 for entry in manifest["files"].values())


def test_state_that_is_not_json_is_rejected_before_anything_is_written(tmp_path):
    with pytest.raises(TypeError, match="JSON-serializable"):
        CheckpointStore(tmp_path).save(1, {}, {"generator": torch.get_rng_state()})
    assert list(tmp_path.iterdir()) == []


class TiedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.unembed = nn.Linear(4, 6, bias=False)
        self.unembed.weight = self.embed.weight  # two names, one tensor

    def forward(self, tokens):
        return self.unembed(self.embed(tokens))


def test_tied_weights_are_stored_once_and_load_tied(tmp_path):
    torch.manual_seed(0)
    model = TiedModel()
    path = CheckpointStore(tmp_path).save(1, {"policy": model.state_dict()}, {})

    checkpoint = load_checkpoint(path)
    policy = checkpoint.tensors["policy"]
    assert policy["embed.weight"] is policy["unembed.weight"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["tensor_groups"]["policy"]["aliases"] in (
        {"unembed.weight": "embed.weight"},
        {"embed.weight": "unembed.weight"},
    )
    fresh = TiedModel()
    fresh.load_state_dict(policy)
    tokens = torch.tensor([0, 3, 5])
    assert torch.equal(fresh(tokens), model(tokens))
    assert fresh.embed.weight is fresh.unembed.weight


def test_overlapping_views_of_one_storage_keep_their_values(tmp_path):
    whole = torch.arange(10.0)
    path = CheckpointStore(tmp_path).save(1, {"views": {"whole": whole, "head": whole[:4], "odd": whole[1::2]}}, {})
    views = load_checkpoint(path).tensors["views"]
    assert torch.equal(views["whole"], whole) and torch.equal(views["head"], whole[:4])
    assert torch.equal(views["odd"], whole[1::2])


def train_steps(model, optimizer, steps: range):
    for step in steps:
        inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(1000 + step))
        loss = model(inputs).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def make_adamw(model, fused: bool):
    # Two groups with different hyperparameters, as LMLearner has for actor and critic.
    return torch.optim.AdamW(
        [
            {"params": [model.weight], "lr": 1e-2, "base_lr": 1e-2},
            {"params": [model.bias], "lr": 3e-3, "base_lr": 3e-3},
        ],
        betas=(0.8, 0.95),
        weight_decay=0.1,
        fused=fused,
    )


@pytest.mark.parametrize("fused", [False, True])
def test_optimizer_round_trip_continues_training_bitwise_identically(tmp_path, fused):
    torch.manual_seed(0)
    uninterrupted = nn.Linear(4, 3)
    interrupted = nn.Linear(4, 3)
    interrupted.load_state_dict(uninterrupted.state_dict())
    train_steps(uninterrupted, make_adamw(uninterrupted, fused), range(6))

    optimizer = make_adamw(interrupted, fused)
    train_steps(interrupted, optimizer, range(3))
    optimizer_group, optimizer_meta = optimizer_tensors(optimizer)
    path = CheckpointStore(tmp_path).save(
        3, {"policy": interrupted.state_dict(), "optimizer": optimizer_group}, {"optimizer": optimizer_meta}
    )
    assert "state.0.exp_avg" in optimizer_group and "state.1.exp_avg_sq" in optimizer_group

    checkpoint = load_checkpoint(path)
    resumed = nn.Linear(4, 3)  # a different initialisation, overwritten by the checkpoint
    resumed.load_state_dict(checkpoint.tensors["policy"])
    resumed_optimizer = torch.optim.AdamW(
        [{"params": [resumed.weight]}, {"params": [resumed.bias]}], lr=1.0, fused=fused
    )
    load_optimizer(resumed_optimizer, checkpoint.tensors["optimizer"], checkpoint.state["optimizer"])
    assert resumed_optimizer.param_groups[0]["betas"] == (0.8, 0.95)
    assert resumed_optimizer.param_groups[1]["lr"] == 3e-3
    train_steps(resumed, resumed_optimizer, range(3, 6))

    assert torch.equal(resumed.weight, uninterrupted.weight) and torch.equal(resumed.bias, uninterrupted.bias)


class CountingSGD(torch.optim.SGD):
    """SGD with momentum that also counts its steps as a plain float, as some optimizers do."""

    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                self.state[param]["step"] = self.state[param].get("step", 0.0) + 1.0
        return super().step(closure)


def test_optimizer_state_with_a_float_step_round_trips():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = CountingSGD(model.parameters(), lr=0.1, momentum=0.9)
    train_steps(model, optimizer, range(2))
    tensors, meta = optimizer_tensors(optimizer)
    meta = json.loads(json.dumps(meta))  # as it comes back from state.json
    fresh = CountingSGD(model.parameters(), lr=0.5, momentum=0.9)
    load_optimizer(fresh, tensors, meta)

    assert "state.0.momentum_buffer" in tensors and meta["state"]["0"]["step"] == 2.0
    for param in model.parameters():
        assert fresh.state[param]["step"] == 2.0
        assert torch.equal(fresh.state[param]["momentum_buffer"], optimizer.state[param]["momentum_buffer"])
    assert fresh.param_groups[0]["lr"] == 0.1


def test_rotation_keeps_the_last_checkpoints_and_the_best(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2, keep_best=1, best_metric="reward", mode="max")
    for step, reward in enumerate([0.1, 0.9, 0.3, 0.2, 0.4, 0.5], start=1):
        store.save(step, small_group(step), {"step": step}, metrics={"reward": reward})

    assert [path.name for path in store.list()] == ["step-00000002", "step-00000005", "step-00000006"]
    assert store.best() == tmp_path / "step-00000002" and store.latest() == tmp_path / "step-00000006"
    assert not list(tmp_path.glob(".tmp-*"))


def test_rotation_in_min_mode_and_never_deletes_the_checkpoint_just_written(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=0, keep_best=1, best_metric="loss", mode="min")
    store.save(1, small_group(), {}, metrics={"loss": 0.2})
    store.save(2, small_group(), {}, metrics={"loss": 0.7})  # worse, but just written
    assert [path.name for path in store.list()] == ["step-00000001", "step-00000002"]
    store.save(3, small_group(), {}, metrics={"loss": 0.1})
    assert [path.name for path in store.list()] == ["step-00000003"]


def test_saving_an_existing_step_replaces_it(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(4, small_group(1.0), {"attempt": 1})
    path = store.save(4, small_group(2.0), {"attempt": 2})
    checkpoint = load_checkpoint(path)
    assert checkpoint.state == {"attempt": 2}
    assert torch.equal(checkpoint.tensors["policy"]["w"], torch.full((3, 2), 2.0))
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000004"]


def test_corrupted_newest_checkpoint_is_skipped_and_refused(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=3)
    store.save(1, small_group(1.0), {"step": 1})
    newest = store.save(2, small_group(2.0), {"step": 2})
    tensor_file = newest / "policy.safetensors"
    data = bytearray(tensor_file.read_bytes())
    data[-3] ^= 0xFF  # a flipped bit in the tensor data: the file still parses, the values are wrong
    tensor_file.write_bytes(bytes(data))

    with pytest.warns(RuntimeWarning, match="step-00000002"):
        latest = store.latest()
    assert latest == tmp_path / "step-00000001" and load_checkpoint(latest).state == {"step": 1}
    with pytest.raises(ValueError, match=r"corrupted.*policy\.safetensors.*older checkpoint"):
        load_checkpoint(newest)


def test_checkpoint_without_manifest_is_not_listed(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(1, small_group(), {})
    (tmp_path / "step-00000009").mkdir()  # e.g. a folder copied in by hand, half-way
    assert store.list() == [tmp_path / "step-00000001"] and store.latest() == tmp_path / "step-00000001"
    with pytest.raises(ValueError, match="manifest.json is missing"):
        load_checkpoint(tmp_path / "step-00000009")


WRITER = textwrap.dedent("""
    import sys, threading, torch
    import unipg.checkpoint.files as files
    from unipg.checkpoint.store import CheckpointStore
    save_file = files.save_file
    def save_and_stop_inside_step_2(tensors, path):  # the kill comes while checkpoint 2 is half written
        save_file(tensors, path)
        if path.parent.name.startswith(".tmp-step-00000002-"):
            print("writing checkpoint 2", flush=True)
            threading.Event().wait()
    files.save_file = save_and_stop_inside_step_2
    store = CheckpointStore(sys.argv[1])
    store.save(1, {"policy": {"w": torch.arange(10.0)}}, {"step": 1})
    shard = torch.ones(4_000_000)  # 16 MB, written once per group: 256 MB in 16 files
    store.save(2, {f"shard{i:02d}": {"w": shard} for i in range(16)}, {"step": 2})
""")


def test_kill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    started = writer.stdout.readline()  # the writer stops itself there, so the kill cannot come too late
    assert started == b"writing checkpoint 2\n", f"the writer exited early: {writer.stderr.read().decode()}"
    os.kill(writer.pid, signal.SIGKILL)
    writer.communicate()
    assert writer.returncode == -signal.SIGKILL

    store = CheckpointStore(tmp_path)
    assert list(tmp_path.glob(".tmp-step-00000002-*")), "the interrupted write should be left behind"
    assert store.list() == [tmp_path / "step-00000001"]
    assert store.latest() == tmp_path / "step-00000001"
    checkpoint = load_checkpoint(store.latest())
    assert checkpoint.state == {"step": 1} and torch.equal(checkpoint.tensors["policy"]["w"], torch.arange(10.0))

    store.save(3, small_group(), {"step": 3})
    assert not list(tmp_path.glob(".tmp-*"))
    assert [path.name for path in store.list()] == ["step-00000001", "step-00000003"]
