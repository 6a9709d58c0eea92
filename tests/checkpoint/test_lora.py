"""LoRA runs keep only the adapter: checkpoints in the PEFT format, weight syncs of the adapter's tensors."""

import pytest
import torch

from tests.helpers.configs import tiny_lm_overrides
from unipg.checkpoint.files import load_checkpoint
from unipg.checkpoint.store import CheckpointStore
from unipg.config import load_config
from unipg.policy.adapters import save_adapter, synced_state
from unipg.policy.loading import load_causal_lm, load_lm_policy
from unipg.runtime.driver import WeightSync
from unipg.runtime.lm import train_lm

peft = pytest.importorskip("peft")

SMALL = tiny_lm_overrides(
    "train.micro_batch_size=8",
    "deterministic=true",
    "algorithm=grpo",
    "estimator.kl_coef=0.05",
    "model.lora_rank=4",
    "train.learning_rate=1e-2",
    "estimator.entropy_coef=0.05",
    "checkpoint.every_updates=1",
    "checkpoint.keep_best=false",
)


def config(embedded_path, output_dir, name, updates):
    return load_config(
        None,
        SMALL
        + [
            f"model.name={embedded_path}",
            f"log.output_dir={output_dir}",
            f"log.run_name={name}",
            f"train.updates={updates}",
        ],
    )


def moved_lora_policy(embedded_path):
    policy = load_lm_policy(embedded_path, lora_rank=4)
    with torch.no_grad():
        for name, parameter in policy.model.named_parameters():
            if "lora_B" in name:
                parameter.add_(0.05)
    return policy


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_save_adapter_writes_what_peft_loads(embedded_path, tmp_path):
    policy = moved_lora_policy(embedded_path)
    folder = save_adapter(policy.model, tmp_path / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in folder.iterdir()}
    loaded = peft.PeftModel.from_pretrained(load_causal_lm(embedded_path), folder)
    ids = torch.tensor([[3, 20, 21, 22, 23]])
    assert torch.allclose(logits(loaded, ids), logits(policy.model, ids), atol=1e-6)


def test_weight_sync_sends_only_the_adapter(embedded_path):
    source, target = moved_lora_policy(embedded_path), load_lm_policy(embedded_path, lora_rank=4)
    state = synced_state(source.model)
    assert state and all("lora_" in name for name in state)
    assert sum(t.numel() for t in state.values()) < 0.2 * sum(t.numel() for t in source.model.parameters())
    sync = WeightSync(source.model, target.model)
    sync.publish(1)
    assert sync.pull() == 1
    ids = torch.tensor([[3, 20, 21, 22, 23]])
    assert torch.allclose(logits(target.model, ids), logits(source.model, ids), atol=1e-6)


@pytest.mark.e2e
def test_lora_checkpoints_hold_the_adapter_in_peft_format_and_resume_exactly(embedded_path, tmp_path):
    straight = train_lm(config(embedded_path, tmp_path, "straight", 2))
    first = train_lm(config(embedded_path, tmp_path, "split", 1))
    resumed = train_lm(config(embedded_path, tmp_path, "split", 2), resume=first.run_dir)
    assert resumed.resumed_from == 1
    folder = CheckpointStore(resumed.run_dir / "checkpoints").latest()
    names = {p.name for p in folder.iterdir()}
    assert "adapter_model.safetensors" in names and "adapter_config.json" in names and "policy.safetensors" not in names
    expected = load_checkpoint(CheckpointStore(straight.run_dir / "checkpoints").latest()).tensors
    got = load_checkpoint(folder).tensors
    for name, tensor in expected["adapter_model"].items():
        assert torch.equal(got["adapter_model"][name], tensor), name
    loaded = peft.PeftModel.from_pretrained(load_causal_lm(embedded_path), folder)
    base = load_causal_lm(embedded_path)
    ids = torch.tensor([[3, 20, 21, 22, 23]])
    assert not torch.allclose(logits(loaded, ids), logits(base, ids), atol=1e-4)  # the trained adapter is in it
