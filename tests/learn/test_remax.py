"""ReMax through the learner: the greedy baseline's rewards reach the advantage, the loss and its gradient by hand, the
zero-advantage identity, and one update of the embedded model."""

import math

import pytest
import torch

from tests.helpers.batches import GROUP, make_batch, make_config
from unipg.learn.lm import LMLearner
from unipg.learn.lm_batch import LMBatch, lm_advantages
from unipg.learn.objective import ObjectiveBatch, unified_objective

# three prompts, one completion each (the preset's), of 2, 1 and 3 sampled tokens
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
LOGPROBS = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0], [-1.0, -1.0, -2.0]])


def hand_batch(scores: list[float], greedy: list[float] | None) -> LMBatch:
    rows, width = MASK.shape
    return LMBatch(
        input_ids=torch.ones((rows, 1 + width), dtype=torch.long),
        attention_mask=torch.cat([torch.ones((rows, 1), dtype=torch.long), MASK.long()], 1),
        completion_mask=MASK.clone(),
        behaviour_logprobs=LOGPROBS * MASK,
        scores=torch.tensor(scores),
        greedy_scores=None if greedy is None else torch.tensor(greedy),
    )


def remax_loss(batch: LMBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The preset's loss (vanilla policy gradient, token-mean) on ``batch`` on-policy, and d loss / d log π."""
    settings = make_config("remax", "sample.samples_per_prompt=1").estimator
    batch.advantages, _ = lm_advantages(batch, settings, group_size=1, kl_coef=0.0)
    logprobs = (LOGPROBS * MASK).clone().requires_grad_(True)
    objective = ObjectiveBatch(logprobs, batch.behaviour_logprobs, batch.advantages, MASK)
    loss = unified_objective(objective, settings).loss
    loss.backward()
    return loss.detach(), logprobs.grad


def test_the_remax_loss_and_gradient_by_hand():
    # A = r − r(greedy) = [1 − 0, 0 − 0, 0.5 − 1] = [1, 0, −0.5], on every token of each completion
    loss, gradient = remax_loss(hand_batch([1.0, 0.0, 0.5], [0.0, 0.0, 1.0]))
    # token-mean of −A_t log π_t over the 6 sampled tokens: −(1·(−1 − 2) + 0 − 0.5·(−1 − 1 − 2)) / 6 = 1/6
    assert loss.item() == pytest.approx(1 / 6)
    expected = torch.tensor([[-1 / 6, -1 / 6, 0.0], [0.0, 0.0, 0.0], [1 / 12, 1 / 12, 1 / 12]])
    assert torch.allclose(gradient, expected)


def test_greedy_rewards_equal_to_the_sampled_ones_give_no_advantage_and_no_gradient():
    scores = [0.3, 1.0, 0.0]
    batch = hand_batch(scores, scores)
    loss, gradient = remax_loss(batch)
    assert torch.equal(batch.advantages, torch.zeros_like(MASK))
    assert loss.item() == 0.0 and torch.equal(gradient, torch.zeros_like(MASK))


def test_a_batch_without_greedy_episodes_is_refused_with_what_is_missing():
    with pytest.raises(ValueError, match="greedy episode of its prompt"):
        remax_loss(hand_batch([1.0, 0.0, 0.5], None))


def test_a_remax_update_moves_the_policy_by_the_greedy_baseline(tiny_policy, one_torch_thread):
    policy = tiny_policy()
    config = make_config("remax", f"sample.samples_per_prompt={GROUP}", "train.micro_batch_size=8")
    learner = LMLearner(policy, config)
    batch = make_batch(policy)
    batch.greedy_scores = torch.arange(len(batch.scores)).div(GROUP, rounding_mode="floor").float() * 0.5  # per prompt
    learner.prepare(batch)
    lengths = batch.completion_mask.sum(1)
    assert torch.allclose(batch.advantages.sum(1) / lengths, batch.scores - batch.greedy_scores)
    before = [parameter.detach().clone() for parameter in policy.model.parameters()]
    metrics = learner.update(batch)
    assert all(math.isfinite(value) for value in metrics.values()) and metrics["grad_norm"] > 0
    assert any(not torch.equal(old, new) for old, new in zip(before, policy.model.parameters()))
