"""The engine gap (π_trainer_old vs μ_engine), measured and corrected by truncated importance sampling in the
one objective: hand-computed weights and gradients, no change when the two agree, and the learner's metrics."""

import copy
import math

import pytest
import torch

from tests.helpers.batches import make_batch, make_config
from unipg.config.schema import EstimatorConfig
from unipg.learn.lm import LMLearner
from unipg.learn.objective import ObjectiveBatch, unified_objective


def gap_batch() -> ObjectiveBatch:
    """Row 0 sampled at the current version (age 0), row 1 one version earlier; row 1's last token is padding.
    On row 0 π_trainer_old/μ_engine = (2.5, 0.9), and π_θ = π_trainer_old (the update's first step)."""
    trainer_old = torch.log(torch.tensor([[0.5, 0.45], [0.5, 0.9]]))
    return ObjectiveBatch(
        logprobs=torch.log(torch.tensor([[0.5, 0.45], [0.5, 0.9]])).requires_grad_(),
        behaviour_logprobs=torch.log(torch.tensor([[0.2, 0.5], [0.25, 0.9]])),
        advantages=torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
        mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
        proximal_logprobs=trainer_old,
        age=torch.tensor([0.0, 1.0]),
    )


def test_tis_caps_the_engine_weight_of_fresh_tokens_and_leaves_stale_ones_to_staleness():
    batch = gap_batch()
    out = unified_objective(batch, EstimatorConfig(policy_loss="vanilla"), tis_cap=2.0)
    out.loss.backward()
    # −A·log π·w, token-mean over 3 tokens; w = (min(2.5, 2), 0.9) on row 0, 1 on the stale token
    assert torch.allclose(batch.logprobs.grad, torch.tensor([[-2.0, -0.9], [-1.0, 0.0]]) / 3)


def test_tis_anchors_the_ppo_ratio_on_the_trainer_and_weighs_the_gap():
    settings = EstimatorConfig(policy_loss="ppo", clip_range=0.2)
    corrected = unified_objective(gap_batch(), settings, tis_cap=2.0)
    # row 0: ρ = π_θ/π_trainer_old = 1, weighted (2, 0.9); row 1 (stale): ρ = π_θ/μ = 2, clipped at 1.2
    assert corrected.loss.item() == pytest.approx(-(2.0 + 0.9 + 1.2) / 3)
    assert corrected.metrics["approx_kl"] == pytest.approx((2.0 - 1.0 - math.log(2.0)) / 3)  # k3, only row 1 ≠ 0
    plain = unified_objective(gap_batch(), settings)
    # without correction row 0's ρ = π_θ/μ_engine = (2.5, 0.9): the engine gap alone trips the clip
    assert plain.loss.item() == pytest.approx(-(1.2 + 0.9 + 1.2) / 3)


@pytest.mark.parametrize(
    "policy_loss, weight",
    [
        ("ppo", "none"),
        ("decoupled_ppo", "none"),
        ("vanilla", "none"),
        ("ppo", "truncated_is"),
        ("decoupled_ppo", "age_decay"),
    ],
)
def test_without_an_engine_gap_the_corrected_loss_and_gradient_equal_the_plain_ones(policy_loss, weight):
    settings = EstimatorConfig(policy_loss=policy_loss, off_policy_weight=weight, behaviour_weight_cap=3.0)
    gradients, losses = [], []
    for tis_cap in (None, 2.0):
        batch = gap_batch()
        batch.logprobs = (batch.logprobs.detach() + torch.tensor([[0.1, -0.3], [0.2, 0.0]])).requires_grad_()
        batch.proximal_logprobs = batch.behaviour_logprobs.clone()  # the engine agrees with the trainer
        out = unified_objective(batch, settings, tis_cap=tis_cap, report_importance_ess=True)
        out.loss.backward()
        losses.append(out.metrics)
        gradients.append(batch.logprobs.grad)
    assert torch.allclose(gradients[0], gradients[1], atol=1e-6, rtol=0)
    assert all(losses[1][key] == pytest.approx(value, abs=1e-6) for key, value in losses[0].items())


def test_tis_needs_the_trainers_log_probs():
    batch = gap_batch()
    batch.proximal_logprobs = None
    with pytest.raises(ValueError, match="needs the trainer's log-probs before the update"):
        unified_objective(batch, EstimatorConfig(policy_loss="ppo"), tis_cap=2.0)


def test_tis_is_on_when_asked_or_when_the_engine_is_not_the_trainers_model():
    assert make_config("grpo").engine_tis_cap is None  # auto with the hf engine (or none configured)
    assert make_config("grpo", "train.tis=on", "train.tis_cap=1.5").engine_tis_cap == 1.5
    assert make_config("grpo", "train.tis=off").engine_tis_cap is None
    config = make_config("grpo")
    vllm = config.model_copy(update={"sample": config.sample.model_copy()})
    object.__setattr__(vllm.sample, "engine", "vllm")  # the engine setting, where it exists
    assert vllm.engine_tis_cap == config.train.tis_cap
    assert any("'train.tis_cap' has no effect" in w for w in make_config("grpo", "train.tis_cap=3").warnings)


@pytest.fixture
def policy(tiny_policy):
    return tiny_policy(needs_reference=True)


def test_learner_measures_the_gap_and_without_one_updates_like_the_uncorrected_learner(policy):
    corrected = LMLearner(copy.deepcopy(policy), make_config("grpo", "train.tis=on", "estimator.kl_coef=0.1"))
    plain = LMLearner(copy.deepcopy(policy), make_config("grpo", "estimator.kl_coef=0.1"))
    batch = make_batch(policy)
    batch.ages = torch.zeros_like(batch.completion_mask)
    same = copy.deepcopy(batch)
    batch.behaviour_logprobs = batch.behaviour_logprobs + 0.05 * batch.completion_mask  # the engine's own numbers
    metrics = corrected.prepare(batch)
    tokens = float(batch.completion_mask.sum())
    assert metrics["mismatch/tokens"] == tokens
    assert metrics["mismatch/max_ratio"] == pytest.approx(torch.exp(torch.tensor(-0.05)).item(), rel=1e-3)
    assert metrics["mismatch/k3"] == pytest.approx(0.05**2 / 2, rel=0.05)  # k3 ≈ (log r)²/2 for small gaps
    assert metrics["mismatch/fraction_capped"] == 0.0
    # with the engine's log-probs equal to the trainer's, the corrected update equals the plain one
    same.behaviour_logprobs = batch.proximal_logprobs.clone()
    gapless = copy.deepcopy(same)
    plain.prepare(same)
    plain.update(same)
    corrected.prepare(gapless)
    corrected.update(gapless)
    for before, after in zip(plain.policy.actor_parameters(), corrected.policy.actor_parameters()):
        assert torch.allclose(before, after, atol=1e-6, rtol=0)
