"""The presets that pair group advantages with another policy loss (GSPO, LUSPO, VESPO, CISPO, SAPO, GMPO, Clip-Cov,
KL-Cov, GPG): one update of the embedded model through the learner, two optimizer steps so that the second one is
off-policy."""

import math

import pytest
import torch

from tests.helpers.batches import GROUP, make_batch, make_config
from tests.helpers.configs import tiny_lm_overrides
from unipg.config import load_config
from unipg.config.policy_loss_presets import POLICY_LOSS_PRESETS
from unipg.estimate.group_advantages import opo_advantages
from unipg.estimate.token_baselines import optimal_token_baseline_advantages
from unipg.learn.lm import LMLearner, token_rewards
from unipg.observe.metrics import read_metrics
from unipg.runtime.lm import train_lm

# what each loss reports beside policy_loss and approx_kl
OWN_METRIC = {
    "gspo": "clip_fraction",
    "luspo": "clip_fraction",
    "vespo": "kernel_mean",
    "cispo": "clip_fraction",
    "sapo": "gate_slope_mean",
    "gmpo": "clip_fraction",
    "clip_cov": "cov_clip_fraction",
    "kl_cov": "kl_cov_fraction",
    "gpg": "approx_kl",  # the vanilla loss reports nothing of its own; the objective adds approx_kl
}


def test_every_policy_loss_preset_is_checked_here():
    assert set(OWN_METRIC) == set(POLICY_LOSS_PRESETS)


@pytest.mark.parametrize("algorithm", sorted(OWN_METRIC))
def test_a_preset_update_moves_the_policy_through_its_loss(tiny_policy, one_torch_thread, algorithm):
    config = make_config(algorithm, "train.mini_batch_size=8", "train.micro_batch_size=8")
    assert config.estimator.policy_loss == POLICY_LOSS_PRESETS[algorithm][1]["policy_loss"]
    assert config.estimator.kl_coef == 0.0
    policy = tiny_policy()
    learner = LMLearner(policy, config)
    batch = make_batch(policy)
    learner.prepare(batch)
    before = [parameter.detach().clone() for parameter in policy.model.parameters()]
    metrics = learner.update(batch)
    assert {"policy_loss", "approx_kl", "grad_norm", OWN_METRIC[algorithm]} <= set(metrics)
    assert all(math.isfinite(value) for value in metrics.values())
    assert metrics["grad_norm"] > 0
    assert any(not torch.equal(old, new) for old, new in zip(before, policy.model.parameters()))


def test_length_weighted_group_estimators_read_each_completions_length(tiny_policy, one_torch_thread):
    policy = tiny_policy()
    learner = LMLearner(policy, make_config("grpo", "estimator.advantage=opo"))
    batch = make_batch(policy)
    learner.prepare(batch)
    lengths = batch.completion_mask.sum(1)
    assert len(set(lengths.tolist())) > 1  # the lengths differ, so the weighting matters
    expected = opo_advantages(batch.scores, lengths, group_size=GROUP)
    assert torch.allclose(batch.advantages.sum(1) / lengths, expected)


def test_the_optimal_token_baseline_reads_the_policys_sum_pi_squared(tiny_policy, one_torch_thread):
    policy = tiny_policy()
    learner = LMLearner(policy, make_config("grpo", "estimator.advantage=optimal_token_baseline"))
    batch = make_batch(policy)
    learner.prepare(batch)
    mask = batch.completion_mask
    valid = mask.bool()
    # Σ_v π_v² lies in (0, 1] and is at least the sampled token's own π²
    assert bool((batch.sum_pi_squared[valid] > 0).all() and (batch.sum_pi_squared[valid] <= 1 + 1e-6).all())
    assert bool((batch.sum_pi_squared[valid] >= (2 * batch.behaviour_logprobs[valid]).exp() - 1e-6).all())
    groups = torch.arange(len(batch.scores)) // GROUP
    expected, _ = optimal_token_baseline_advantages(
        token_rewards(batch, None, 0.0), mask, batch.behaviour_logprobs, batch.sum_pi_squared, groups
    )
    assert torch.allclose(batch.advantages, expected, atol=1e-6)
    assert learner.update(batch)["grad_norm"] > 0


@pytest.mark.e2e
@pytest.mark.parametrize("algorithm", ["gspo", "sapo"])
def test_a_short_run_of_a_sequence_and_a_gated_preset(embedded_path, tmp_path, algorithm):
    overrides = tiny_lm_overrides(
        f"algorithm={algorithm}",
        "train.mini_batch_size=4",
        "train.micro_batch_size=4",
        "train.updates=2",
        "eval.pass_k=0",
        "checkpoint.every_updates=0",
        f"model.name={embedded_path}",
        f"log.output_dir={tmp_path}",
        num_test=4,
    )
    result = train_lm(load_config(None, overrides))
    assert result.updates == 2
    records = [r for r in read_metrics(result.run_dir) if "train/policy_loss" in r]
    assert len(records) == 2 and all(math.isfinite(r["train/policy_loss"]) for r in records)
    assert all("train/approx_kl" in r for r in records)
