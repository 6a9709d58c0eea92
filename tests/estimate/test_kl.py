"""KL estimators k1/k2/k3: hand values, unbiasedness by sampling, signs."""

from __future__ import annotations

import math

import pytest
import torch

from unipg.estimate.kl import KL_ESTIMATORS, kl_k1, kl_k2, kl_k3, kl_penalty
from unipg.registry import RegistryError


def test_hand_values():
    logprobs, ref_logprobs = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    # r = π_ref / π_θ = 0.5, log r = −log 2
    log2 = math.log(2)
    assert kl_penalty(logprobs, ref_logprobs, estimator="k1").item() == pytest.approx(log2)
    assert kl_penalty(logprobs, ref_logprobs, estimator="k2").item() == pytest.approx(0.5 * log2**2)
    assert kl_penalty(logprobs, ref_logprobs, estimator="k3").item() == pytest.approx(0.5 - 1 + log2)
    assert torch.equal(kl_penalty(logprobs, ref_logprobs), kl_k3(logprobs, ref_logprobs))


def test_estimators_are_zero_when_policies_agree():
    logprobs = torch.randn(3, 4)
    for name in ("k1", "k2", "k3"):
        assert torch.all(kl_penalty(logprobs, logprobs.clone(), estimator=name) == 0)


def test_k1_and_k3_are_unbiased_and_k2_is_not():
    generator = torch.Generator().manual_seed(0)
    policy_logprobs = torch.log_softmax(torch.randn(8, generator=generator, dtype=torch.float64), dim=-1)
    ref_logprobs = torch.log_softmax(torch.randn(8, generator=generator, dtype=torch.float64), dim=-1)
    exact = (policy_logprobs.exp() * (policy_logprobs - ref_logprobs)).sum().item()  # KL(π‖ref)
    actions = torch.multinomial(policy_logprobs.exp(), 200_000, replacement=True, generator=generator)
    sampled, sampled_ref = policy_logprobs[actions][None], ref_logprobs[actions][None]  # (1, N)
    for estimator in (kl_k1, kl_k3):
        samples = estimator(sampled, sampled_ref)
        standard_error = samples.std().item() / math.sqrt(samples.numel())
        assert abs(samples.mean().item() - exact) < 4 * standard_error + 1e-4
    assert kl_k1(sampled, sampled_ref).min() < 0  # k1 is negative on some samples
    exact_k2_mean = (policy_logprobs.exp() * 0.5 * (policy_logprobs - ref_logprobs) ** 2).sum().item()
    assert kl_k2(sampled, sampled_ref).mean().item() == pytest.approx(exact_k2_mean, rel=0.02)
    assert abs(exact_k2_mean - exact) > 0.05  # biased: k2 estimates a different quantity


def test_k2_and_k3_are_never_negative():
    generator = torch.Generator().manual_seed(1)
    logprobs = 5 * torch.randn(200, 50, generator=generator)
    ref_logprobs = 5 * torch.randn(200, 50, generator=generator)
    tiny = logprobs + 1e-7 * torch.randn(200, 50, generator=generator)  # round-off regime r ≈ 1
    for ref in (ref_logprobs, tiny):
        assert torch.all(kl_k2(logprobs, ref) >= 0)
        assert torch.all(kl_k3(logprobs, ref) >= 0)


def test_registry_names_and_unknown_estimator():
    assert KL_ESTIMATORS.names() == ["k1", "k2", "k3"]
    with pytest.raises(RegistryError, match="Valid names: k1, k2, k3"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), estimator="k4")
    with pytest.raises(RegistryError, match="already registered"):
        KL_ESTIMATORS.register("k3")(kl_k3)
