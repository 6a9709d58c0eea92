"""estimator.ref_sync_steps: the learner moves its reference copy towards the policy every τ updates, a checkpoint
keeps the moved reference, and the settings it cannot serve are refused when the config loads."""

import pytest
import torch

from tests.helpers.batches import make_batch, make_config
from tests.helpers.configs import tiny_lm_overrides
from unipg.checkpoint.files import load_checkpoint
from unipg.checkpoint.store import CheckpointStore
from unipg.config import load_config
from unipg.config.section import ConfigError
from unipg.learn.lm import LMLearner
from unipg.policy.loading import load_causal_lm
from unipg.runtime.lm import train_lm

ALPHA = 0.6


def parameters(module: torch.nn.Module) -> list[torch.Tensor]:
    return [parameter.detach().clone() for parameter in module.parameters()]


def test_the_reference_moves_every_tau_updates_and_only_then(tiny_policy, one_torch_thread):
    config = make_config("grpo", "estimator.ref_sync_steps=2", f"estimator.ref_sync_alpha={ALPHA}")
    policy = tiny_policy(reference="copy")
    learner = LMLearner(policy, config)
    initial = parameters(policy.reference_model)
    batch = make_batch(policy)
    learner.prepare(batch)
    learner.update(batch)
    assert all(torch.equal(now, then) for now, then in zip(policy.reference_model.parameters(), initial))
    assert not all(torch.equal(p, r) for p, r in zip(policy.model.parameters(), initial))  # the policy moved
    learner.prepare(batch)
    learner.update(batch)
    for reference, current, old in zip(policy.reference_model.parameters(), policy.model.parameters(), initial):
        assert reference.dtype == torch.float32
        assert torch.equal(reference, ALPHA * current + (1 - ALPHA) * old)  # bit for bit
    assert learner.state({})["updates"] == 2


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (["algorithm=gspo"], "which this run does not hold"),
        (["algorithm=grpo", "model.lora_rank=4"], "cannot move a LoRA run's reference"),
        (["algorithm=grpo", "train.learner_processes=2"], "not supported with a sharded learner"),
    ],
)
def test_a_reference_that_cannot_move_is_refused_when_the_config_loads(overrides, problem):
    with pytest.raises(ConfigError, match=problem):
        load_config(None, ["task.name=arithmetic", "estimator.ref_sync_steps=4", *overrides])


SYNCED = tiny_lm_overrides(
    "train.micro_batch_size=8",
    "deterministic=true",
    "algorithm=grpo",
    "estimator.kl_coef=0.05",
    "estimator.ref_sync_steps=2",
    "train.learning_rate=1e-2",
    "eval.pass_k=0",
    "checkpoint.every_updates=1",
    "checkpoint.keep_best=false",
)


def synced_run(embedded_path, output_dir, name, updates, resume=None):
    overrides = [f"model.name={embedded_path}", f"log.output_dir={output_dir}", f"log.run_name={name}"]
    return train_lm(load_config(None, [*SYNCED, *overrides, f"train.updates={updates}"]), resume=resume)


@pytest.mark.e2e
def test_a_resumed_run_keeps_the_moved_reference_and_its_schedule_bit_for_bit(embedded_path, tmp_path):
    # the reference moves after updates 2 and 4; the split run stops after 3, so its update 4 reads the reference
    # moved at 2 from the checkpoint (through the KL term) and must know that its 4th update moves it again
    straight = synced_run(embedded_path, tmp_path, "straight", 4)
    first = synced_run(embedded_path, tmp_path, "split", 3)
    resumed = synced_run(embedded_path, tmp_path, "split", 4, resume=first.run_dir)
    assert resumed.resumed_from == 3
    expected = load_checkpoint(CheckpointStore(straight.run_dir / "checkpoints").latest()).tensors
    got = load_checkpoint(CheckpointStore(resumed.run_dir / "checkpoints").latest()).tensors
    for group in ("reference", "policy"):
        for name, tensor in expected[group].items():
            assert torch.equal(got[group][name], tensor), (group, name)
    base = load_causal_lm(embedded_path).state_dict()
    assert any(not torch.equal(tensor, base[name]) for name, tensor in got["reference"].items())
