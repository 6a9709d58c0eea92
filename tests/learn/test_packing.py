"""Padding-free micro-batches: packed forward passes equal padded ones, and token-budget micro-batches give the
gradient of the whole mini-batch under every loss aggregation mode."""

import pytest
import torch

from tests.helpers.batches import skewed_batch, skewed_config
from unipg.estimate.losses import LOSS_AGGREGATIONS, entropy_from_logits
from unipg.learn.lm import LMLearner
from unipg.learn.lm_batch import token_budget_micro_batches
from unipg.policy.forward import chunked_token_statistics, token_logprobs


def gradients(policy, settings, batch) -> list[torch.Tensor]:
    learner = LMLearner(policy, settings)
    learner.optimizer.zero_grad(set_to_none=True)
    learner.accumulate_gradients(batch, torch.arange(len(batch.scores)))
    return [p.grad.clone() for p in learner.parameters]


@pytest.fixture(scope="module")
def plain_policy(tiny_policy):
    return tiny_policy()


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_packed_forward_equals_padded(tiny_policy, lora_rank):
    if lora_rank:
        pytest.importorskip("peft")
    policy = tiny_policy(value_head=True, lora_rank=lora_rank)
    batch = skewed_batch()
    arguments = (batch.input_ids, batch.attention_mask, batch.completion_length)
    padded = policy.evaluate(*arguments, with_entropy=True, with_values=True, temperature=0.7)
    policy.packed = True
    packed = policy.evaluate(*arguments, with_entropy=True, with_values=True, temperature=0.7)
    real = batch.attention_mask[:, -batch.completion_length :].bool()
    for name in ("logprobs", "entropy", "values"):
        assert torch.allclose(getattr(packed, name)[real], getattr(padded, name)[real], atol=1e-5), name
        assert not getattr(packed, name)[~real].any()  # nothing where a row has no token


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_token_budget_micro_batches_give_the_mini_batch_gradient(plain_policy, mode):
    batch = skewed_batch()
    aggregation = f"estimator.loss_agg_mode={mode}"
    whole = gradients(plain_policy, skewed_config(aggregation, "train.micro_batch_size=6"), batch)
    packed = gradients(plain_policy, skewed_config(aggregation, "train.max_tokens_per_micro_batch=24"), batch)
    plain_policy.packed = False
    assert len(token_budget_micro_batches(batch.attention_mask.sum(1), 24)) > 2  # really accumulated
    for expected, got in zip(whole, packed):
        assert torch.allclose(got, expected, atol=1e-5, rtol=1e-4)


def test_packed_gradient_with_critic_and_entropy_equals_padded(tiny_policy):
    policy = tiny_policy(value_head=True)
    batch = skewed_batch(1)
    batch.values = torch.zeros_like(batch.returns)
    settings = ["algorithm=ppo", "estimator.entropy_coef=0.01", "estimator.loss_agg_mode=token-mean"]
    padded = gradients(policy, skewed_config(*settings, "train.micro_batch_size=2"), batch)
    packed = gradients(
        policy, skewed_config(*settings, "train.max_tokens_per_micro_batch=20", "train.logprob_chunk_tokens=7"), batch
    )
    for expected, got in zip(padded, packed):
        assert torch.allclose(got, expected, atol=1e-5, rtol=1e-4)


def test_chunked_logprobs_and_entropy_equal_unchunked_with_their_gradients():
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn((3, 11, 50), generator=generator) * 4).requires_grad_()
    targets = torch.randint(0, 50, (3, 11), generator=generator)
    weights = torch.randn((2, 3, 11), generator=generator)
    logprobs, entropy = token_logprobs(logits, targets), entropy_from_logits(logits)
    expected = torch.autograd.grad((weights[0] * logprobs + weights[1] * entropy).sum(), logits)[0]
    chunked, chunked_entropy = chunked_token_statistics(
        logits, targets, chunk_tokens=4, with_entropy=True, entropy_grad=True
    )
    got = torch.autograd.grad((weights[0] * chunked + weights[1] * chunked_entropy).sum(), logits)[0]
    assert torch.allclose(chunked, logprobs, atol=1e-6) and torch.allclose(chunked_entropy, entropy, atol=1e-6)
    assert torch.allclose(got, expected, atol=1e-6)


def test_token_budget_micro_batches_fit_the_budget_and_cover_every_row():
    lengths = torch.tensor([40, 3, 17, 9, 30, 2, 25])
    groups = token_budget_micro_batches(lengths, 32)
    assert sorted(torch.cat(groups).tolist()) == list(range(len(lengths)))
    assert [int(lengths[g].sum()) for g in groups if len(g) > 1] == [
        min(32, int(lengths[g].sum())) for g in groups if len(g) > 1
    ]
    assert [g.tolist() for g in groups if int(lengths[g].sum()) > 32] == [[0]]  # only the over-long one alone


def saved_activation_numel(policy, batch) -> int:
    """Elements autograd saves for the backward pass of one evaluation."""
    saved = []

    def pack(tensor):
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        policy.evaluate(batch.input_ids, batch.attention_mask, batch.completion_length)
    return sum(saved)


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_gradient_checkpointing_saves_fewer_activations_and_keeps_the_gradient(tiny_policy, lora_rank):
    if lora_rank:
        pytest.importorskip("peft")
    batch = skewed_batch(2)
    results = []
    for checkpointing in (False, True):
        policy = tiny_policy(gradient_checkpointing=checkpointing, lora_rank=lora_rank)
        grads = gradients(policy, skewed_config("train.micro_batch_size=3"), batch)
        assert not any(module.training for module in policy.model.modules())  # dropout stays off
        results.append((grads, saved_activation_numel(policy, batch)))
    (plain, plain_saved), (checkpointed, checkpointed_saved) = results
    assert checkpointed_saved < 0.5 * plain_saved
    assert any(g.abs().sum() > 0 for g in checkpointed)
    for expected, got in zip(plain, checkpointed):
        assert torch.allclose(got, expected, atol=1e-6)
