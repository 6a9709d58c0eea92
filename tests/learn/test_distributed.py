"""The learner sharded with FSDP2 over 2 local gloo processes: one update equals the 1-process update, and
its sharded checkpoint resumes in 1 process."""

from pathlib import Path

import pytest
import torch

from tests.helpers.batches import skewed_batch, skewed_config
from unipg.learn.distributed import (
    free_port,
    full_state_dict,
    group_backend,
    init_group,
    init_local_group,
    load_sharded,
    local_tensor,
    read_shard_index,
    save_sharded,
    shard_model,
    spawn_local,
    sum_across_ranks,
)
from unipg.learn.lm import LMLearner
from unipg.learn.lm_batch import split_across_ranks
from unipg.learn.sharded import _run
from unipg.policy.loading import load_lm_policy

SETTINGS = (
    "train.max_tokens_per_micro_batch=24",
    "train.num_epochs=1",
    "train.learning_rate=1e-3",
    "train.adam_eps=1e-3",
    "estimator.entropy_coef=0.01",
)


def learner(model_path: str, shard: bool = False) -> LMLearner:
    torch.manual_seed(0)
    policy = load_lm_policy(model_path)
    if shard:
        shard_model(policy.model)
    return LMLearner(policy, skewed_config(*SETTINGS))


def update_rank(rank: int, world_size: int, port: int, model_path: str, out: str) -> None:
    torch.set_num_threads(1)
    init_local_group(rank, world_size, port)
    sharded = learner(model_path, shard=True)
    metrics = sharded.update(skewed_batch())
    state = full_state_dict(sharded.policy.model)
    save_sharded(Path(out) / "checkpoint", sharded.policy.model, sharded.optimizer, sharded.masters)
    if rank == 0:
        torch.save({"state": state, "metrics": metrics}, Path(out) / "result.pt")
    torch.distributed.destroy_process_group()


def test_ranks_split_micro_batches_evenly():
    lengths = torch.tensor([30, 3, 10, 10, 2, 5])
    groups = [torch.tensor([0]), torch.tensor([1, 4]), torch.tensor([2]), torch.tensor([3]), torch.tensor([5])]
    ranks = split_across_ranks(groups, lengths, 2)
    assert [len(mine) for mine in ranks] == [3, 3] and ranks[0][0].tolist() == [0]
    assert sorted(int(lengths[g].sum()) for mine in ranks for g in mine if g is not None) == [5, 5, 10, 10, 30]
    assert ranks[0][-1] is None  # the rank holding the longest sequence runs an empty pass to keep in step


def test_two_process_update_equals_one_process_and_its_checkpoint_resumes_in_one(embedded_path, tmp_path):
    spawn_local(update_rank, 2, embedded_path, str(tmp_path))
    result = torch.load(tmp_path / "result.pt")
    single = learner(embedded_path)
    metrics = single.update(skewed_batch())
    for name, tensor in single.policy.model.state_dict().items():
        assert torch.allclose(result["state"][name], tensor, atol=1e-5), name
    assert metrics["loss"] == pytest.approx(result["metrics"]["loss"], abs=1e-5)
    assert metrics["grad_norm"] == pytest.approx(result["metrics"]["grad_norm"], rel=1e-4)
    resumed = learner(embedded_path)
    load_sharded(tmp_path / "checkpoint", resumed.policy.model, resumed.optimizer, resumed.masters)
    for name, tensor in resumed.policy.model.state_dict().items():
        assert torch.equal(tensor, result["state"][name]), name
    for parameter, twin in zip(resumed.parameters, single.parameters):
        moments = resumed.optimizer.state[parameter]["exp_avg_sq"], single.optimizer.state[twin]["exp_avg_sq"]
        assert torch.allclose(*moments, atol=1e-9, rtol=1e-3)


def test_a_cuda_group_adds_up_cpu_metrics_through_gloo(monkeypatch):
    chosen = {}
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda backend, **_: chosen.update(backend=backend))
    init_group(1, 2, "127.0.0.1", 1, device="cuda:1")
    assert chosen["backend"] == "cpu:gloo,cuda:nccl"  # NCCL alone has no backend for sum_across_ranks' CPU tensor
    assert group_backend("cpu") == "gloo"


def test_metrics_add_up_as_cpu_tensors_over_a_group_that_maps_cpu_to_gloo():
    torch.distributed.init_process_group("cpu:gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        assert sum_across_ranks({"loss": 1.5, "count": 2.0}) == {"count": 2.0, "loss": 1.5}
    finally:
        torch.distributed.destroy_process_group()


def bfloat16_critic_rank(rank: int, world_size: int, port: int, model_path: str, out: str) -> None:
    torch.set_num_threads(1)
    init_local_group(rank, world_size, port)
    torch.manual_seed(0)
    critic = load_lm_policy(model_path, dtype="bfloat16", critic=model_path).critic
    shard_model(critic)
    tokens = torch.randint(3, 20, (2, 6), generator=torch.Generator().manual_seed(0))
    values = critic(tokens, torch.ones_like(tokens), 3)
    values.sum().backward()
    if rank == 0:
        torch.save({"values": values.detach(), "head_grad": local_tensor(critic.head.linear.weight.grad)}, out)
    torch.distributed.destroy_process_group()


def test_a_bfloat16_critic_with_a_float32_value_head_shards(embedded_path, tmp_path):
    spawn_local(bfloat16_critic_rank, 2, embedded_path, str(tmp_path / "result.pt"))  # FSDP2 refused mixed dtypes
    result = torch.load(tmp_path / "result.pt")
    assert result["values"].dtype == torch.float32 and result["values"].shape == (2, 3)
    assert result["head_grad"].dtype == torch.float32 and result["head_grad"].abs().sum() > 0


def every_rank_full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full weights on every rank (collective), as the driver sends them for a restore."""
    return {
        name: (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()
        for name, tensor in module.state_dict().items()
    }


def bfloat16_restore_rank(rank: int, world_size: int, port: int, model_path: str, out: str) -> None:
    torch.set_num_threads(1)
    init_local_group(rank, world_size, port)
    torch.manual_seed(0)
    policy = load_lm_policy(model_path, dtype="bfloat16")
    shard_model(policy.model)
    sharded = LMLearner(policy, skewed_config(*SETTINGS))
    sharded.update(skewed_batch())
    shards, state = str(Path(out).parent / "shards"), _run(sharded, "state", ())
    _run(sharded, "save_shards", (shards,))
    saved = every_rank_full_state(policy)
    sharded.update(skewed_batch())  # the masters move on from the checkpoint
    _, sent = _run(sharded, "load_shards", (shards, state))
    _run(sharded, "set_lr_fraction", (0.0,))
    sharded.update(skewed_batch())  # a step of size 0 keeps the restored weights
    after = full_state_dict(policy)
    if rank == 0:
        torch.save({"saved": saved, "after": after, "sent": sent}, out)
    torch.distributed.destroy_process_group()


def test_a_sharded_bfloat16_learner_restores_its_float32_masters_from_its_shards(embedded_path, tmp_path):
    spawn_local(bfloat16_restore_rank, 2, embedded_path, str(tmp_path / "result.pt"))
    result = torch.load(tmp_path / "result.pt")
    for name, tensor in result["saved"].items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(result["after"][name], tensor), name
    for name, tensor in result["sent"].items():  # the restored trained weights, for the driver's policy
        assert torch.equal(tensor, result["saved"][name]), name
    index = read_shard_index(tmp_path / "shards").state_dict_metadata
    masters = {name for name in index if name.startswith("masters.")}
    assert masters and all(index[name].properties.dtype == torch.float32 for name in masters)
