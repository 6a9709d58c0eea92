"""The learner's per-row statistics before an update (reference log-probs, values, proximal log-probs) land on
their own rows when packed micro-batches, balanced by tokens, take the rows out of order."""

import torch

from tests.helpers.batches import skewed_batch, skewed_config
from unipg.learn.lm import LMLearner
from unipg.learn.micro_batches import token_budget_micro_batches

BUDGET = 40  # tokens per packed micro-batch: skewed_batch's rows spread over several, out of order


def prepared(policy, *overrides: str):
    batch = skewed_batch()
    settings = skewed_config("estimator.kl_coef=0.1", "algorithm=ppo", "train.tis=on", *overrides)
    LMLearner(policy, settings).prepare(batch)
    return batch


def test_packed_prepare_keeps_each_rows_statistics_on_its_row(tiny_policy):
    policy = tiny_policy(value_head=True, reference="copy")
    groups = token_budget_micro_batches(skewed_batch().attention_mask.sum(1), BUDGET)
    assert torch.cat(groups).tolist() != sorted(torch.cat(groups).tolist())  # really out of order
    padded = prepared(policy, "train.micro_batch_size=2")
    packed = prepared(policy, f"train.max_tokens_per_micro_batch={BUDGET}")
    real = padded.attention_mask[:, -padded.completion_length :].bool()
    for name in ("reference_logprobs", "values", "proximal_logprobs"):
        expected, got = getattr(padded, name), getattr(packed, name)
        assert expected is not None and torch.allclose(got[real], expected[real], atol=1e-5), name
