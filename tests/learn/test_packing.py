"""Padding-free micro-batches: packed forward passes equal padded ones, and token-budget micro-batches give the
gradient of the whole mini-batch under every loss aggregation mode."""

import pytest
import torch

from tests.helpers.batches import skewed_batch, skewed_config
from unipg.estimate.losses import LOSS_AGGREGATIONS
from unipg.learn.lm import LMLearner
from unipg.learn.micro_batches import plan_micro_batches, token_budget_micro_batches


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
        policy, skewed_config(*settings, "train.max_tokens_per_micro_batch=20", "model.logits_chunk_tokens=7"), batch
    )
    for expected, got in zip(padded, packed):
        assert torch.allclose(got, expected, atol=1e-5, rtol=1e-4)


def test_token_budget_micro_batches_fit_the_budget_and_cover_every_row():
    lengths = torch.tensor([40, 3, 17, 9, 30, 2, 25])
    groups = token_budget_micro_batches(lengths, 32)
    assert sorted(torch.cat(groups).tolist()) == list(range(len(lengths)))
    assert [int(lengths[g].sum()) for g in groups if len(g) > 1] == [
        min(32, int(lengths[g].sum())) for g in groups if len(g) > 1
    ]
    assert [g.tolist() for g in groups if int(lengths[g].sum()) > 32] == [[0]]  # only the over-long one alone


def test_token_budget_micro_batches_are_balanced():
    lengths = torch.tensor([30, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2])  # 62 tokens, budget 32: two
    loads = sorted(int(lengths[g].sum()) for g in token_budget_micro_batches(lengths, 32))
    assert loads == [30, 32]  # first-fit would fill the first to 32 and leave 30
    lengths = torch.tensor([9, 8, 7, 6, 5, 4, 3, 2, 1, 1])  # 46 tokens, budget 16: three of about 15
    loads = sorted(int(lengths[g].sum()) for g in token_budget_micro_batches(lengths, 16))
    assert len(loads) == 3 and loads[-1] - loads[0] <= 2


def grpo_rows(prompt: int, completions: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One GRPO group: the same ``prompt``-token prompt before each of ``completions`` (token counts)."""
    width = max(completions)
    ids = torch.cat([torch.arange(1, prompt + 1).repeat(len(completions), 1), torch.ones(len(completions), width)], 1)
    mask = torch.cat(
        [torch.ones(len(completions), prompt), (torch.arange(width) < torch.tensor(completions)[:, None]).float()], 1
    )
    return ids.long(), mask.long(), width


@pytest.mark.parametrize(
    ("prompt", "completions", "micro_batch_size", "groups"),
    [
        (100, [10, 12, 9, 11], 4, None),  # a long shared prompt, even completions: padding is faster
        (10, [200, 8, 12, 9], 1, [[0], [1, 2, 3]]),  # skewed completions: packed, 1 × the longest 210 tokens each
    ],
)
def test_auto_packs_unless_padding_is_faster(prompt, completions, micro_batch_size, groups):
    ids, mask, width = grpo_rows(prompt, completions)
    rows = torch.arange(len(completions))
    plan = plan_micro_batches(ids, mask, width, rows, micro_batch_size=micro_batch_size, max_tokens="auto")
    assert plan.packed is (groups is not None)
    assert [g.tolist() for g in plan.groups] == (groups or [rows.tolist()])
    for budget, packed in ((None, False), (30, True)):
        plan = plan_micro_batches(ids, mask, width, rows, micro_batch_size=micro_batch_size, max_tokens=budget)
        assert plan.packed is packed
