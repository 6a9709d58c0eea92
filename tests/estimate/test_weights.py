"""Off-policy weights w(ρ, age): hand-computed examples for every registered weight function."""

import math

import pytest
import torch

from unipg.estimate.weights import (
    OFF_POLICY_WEIGHTS,
    OffPolicyWeights,
    combine_weights,
    engine_mismatch_weights,
    weight_metrics,
)
from unipg.registry import RegistryError

# Two sequences of three tokens; the last token of row 1 is padding.
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def batch_with_ratios(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """logprobs and behaviour log-probs whose ratio π/μ is ``ratios`` (padding gets garbage log-probs)."""
    behaviour = torch.log(torch.tensor([[0.3, 0.2, 0.1], [0.5, 0.25, 0.4]]))
    logprobs = behaviour + torch.log(torch.tensor(ratios))
    behaviour[1, 2] = -math.inf  # padding may hold anything; it must not leak into weights or metrics
    return logprobs, behaviour


def compute(name: str, logprobs, behaviour, mask=MASK, **kwargs) -> OffPolicyWeights:
    return OFF_POLICY_WEIGHTS.get(name)(logprobs, behaviour, mask, **kwargs)


def test_registry_lists_every_weight_and_rejects_unknown_names():
    assert OFF_POLICY_WEIGHTS.names() == ["age_decay", "kl_filter", "none", "truncated_is", "version_window"]
    with pytest.raises(RegistryError, match="did you mean 'age_decay'.*kl_filter"):
        OFF_POLICY_WEIGHTS.get("age_decy")


def test_none_is_one_on_valid_tokens_and_has_full_ess():
    logprobs, behaviour = batch_with_ratios([[0.5, 1.5, 4.0], [0.5, 2.0, 1.0]])
    out = compute("none", logprobs, behaviour)
    assert torch.equal(out.weights, MASK)
    assert out.metrics["ess"].item() == pytest.approx(1.0)
    assert out.metrics["fraction_dropped"].item() == 0.0
    assert out.metrics["weight_mean"].item() == pytest.approx(1.0)


def test_truncated_is_token_level_clips_ratio_at_c():
    logprobs, behaviour = batch_with_ratios([[0.5, 1.5, 4.0], [0.5, 2.0, 1.0]])
    logprobs.requires_grad_(True)
    out = compute("truncated_is", logprobs, behaviour, truncation=2.0)
    expected = torch.tensor([[0.5, 1.5, 2.0], [0.5, 2.0, 0.0]])
    torch.testing.assert_close(out.weights, expected)
    assert not out.weights.requires_grad  # a multiplier, never a path for gradient
    # ESS = (Σw)² / (n Σw²) = 6.5² / (5 · 10.75)
    assert out.metrics["ess"].item() == pytest.approx(6.5**2 / (5 * 10.75), rel=1e-6)
    assert out.metrics["fraction_downweighted"].item() == pytest.approx(2 / 5)
    assert out.metrics["fraction_truncated"].item() == pytest.approx(1 / 5)
    assert out.metrics["weight_mean"].item() == pytest.approx(6.5 / 5)


def test_truncated_is_sequence_level_uses_product_of_token_ratios():
    logprobs, behaviour = batch_with_ratios([[0.5, 1.5, 4.0], [0.5, 2.0, 1.0]])
    out = compute("truncated_is", logprobs, behaviour, truncation=2.0, level="sequence")
    # row 0: 0.5·1.5·4 = 3 → truncated to 2; row 1: 0.5·2 = 1 (padding excluded from the product)
    torch.testing.assert_close(out.weights, torch.tensor([[2.0, 2.0, 2.0], [1.0, 1.0, 0.0]]))


def test_truncated_is_survives_huge_ratios():
    logprobs, behaviour = batch_with_ratios([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    logprobs = logprobs + torch.tensor([[500.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    out = compute("truncated_is", logprobs, behaviour, truncation=2.0, level="sequence")
    assert torch.isfinite(out.weights).all()
    assert out.weights[0, 0].item() == pytest.approx(2.0)


def test_age_decay_per_sequence_age():
    logprobs, behaviour = batch_with_ratios([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    out = compute("age_decay", logprobs, behaviour, age=torch.tensor([0, 2]), decay=0.5)
    torch.testing.assert_close(out.weights, torch.tensor([[1.0, 1.0, 1.0], [0.25, 0.25, 0.0]]))
    assert out.metrics["fraction_downweighted"].item() == pytest.approx(2 / 5)
    assert out.metrics["age_mean"].item() == pytest.approx(4 / 5)


def test_age_decay_per_token_age_and_seed_default():
    logprobs, behaviour = batch_with_ratios([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    age = torch.tensor([[0, 1, 2], [3, 0, 99]])  # the 99 sits on padding and is ignored
    out = compute("age_decay", logprobs, behaviour, age=age, decay=0.5)
    torch.testing.assert_close(out.weights, torch.tensor([[1.0, 0.5, 0.25], [0.125, 1.0, 0.0]]))
    # seed 000 §5.2: γ_age = 0.99, a sample 100 versions old weighs ≈ 0.37
    old = compute("age_decay", logprobs, behaviour, age=torch.tensor([100, 100]))
    assert old.weights[0, 0].item() == pytest.approx(0.99**100) and 0.36 < old.weights[0, 0].item() < 0.37
    # equal ages → equal weights → full effective sample size
    assert old.metrics["ess"].item() == pytest.approx(1.0)


def test_kl_filter_drops_exactly_the_sequence_above_threshold():
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    behaviour = torch.log(torch.tensor([[0.4, 0.3], [0.4, 0.3], [0.4, 0.3]]))
    ratios = torch.tensor([[1.0, 1.0], [2.0, 0.5], [1.2, 1 / 1.2]])
    logprobs = behaviour + torch.log(ratios)
    # k3 = (r − 1) − log r per token, averaged per sequence
    kl_row1 = ((1.0 - math.log(2.0)) + (-0.5 + math.log(2.0))) / 2  # = 0.25
    kl_row2 = ((0.2 - math.log(1.2)) + (1 / 1.2 - 1 + math.log(1.2))) / 2  # ≈ 0.0167
    out = compute("kl_filter", logprobs, behaviour, mask, max_kl=0.1)
    torch.testing.assert_close(out.weights, torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]))
    assert out.metrics["fraction_dropped"].item() == pytest.approx(2 / 6)
    assert out.metrics["kl_mean"].item() == pytest.approx((0.0 + kl_row1 + kl_row2) / 3, rel=1e-5)

    soft = compute("kl_filter", logprobs, behaviour, mask, max_kl=0.1, mode="downweight")
    torch.testing.assert_close(soft.weights, torch.tensor([[1.0, 1.0], [0.4, 0.4], [1.0, 1.0]]))
    assert soft.metrics["fraction_downweighted"].item() == pytest.approx(2 / 6)


def test_kl_filter_estimates_kl_of_behaviour_from_current_policy():
    """Tokens sampled from μ: the mean k3 estimate converges to KL(μ‖π), not KL(π‖μ)."""
    generator = torch.Generator().manual_seed(0)
    behaviour_probs = torch.tensor([0.7, 0.2, 0.1])
    current_probs = torch.tensor([0.3, 0.3, 0.4])
    actions = torch.multinomial(behaviour_probs, 200_000, replacement=True, generator=generator)
    logprobs = current_probs.log()[actions].unsqueeze(0)  # (1, T)
    behaviour = behaviour_probs.log()[actions].unsqueeze(0)
    out = compute("kl_filter", logprobs, behaviour, torch.ones_like(logprobs), max_kl=10.0)
    kl_behaviour_current = (behaviour_probs * (behaviour_probs / current_probs).log()).sum().item()
    assert out.metrics["kl_mean"].item() == pytest.approx(kl_behaviour_current, rel=0.03)


def test_version_window_keeps_recent_versions_only():
    logprobs, behaviour = batch_with_ratios([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    age = torch.tensor([[0, 1, 2], [3, 0, 0]])
    out = compute("version_window", logprobs, behaviour, age=age, window=1)
    torch.testing.assert_close(out.weights, torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 0.0]]))
    assert out.metrics["fraction_dropped"].item() == pytest.approx(2 / 5)
    # three equal weights of 1 and two zeros among five tokens: ESS = 3² / (5 · 3)
    assert out.metrics["ess"].item() == pytest.approx(3 / 5)
    on_policy = compute("version_window", logprobs, behaviour, age=age, window=0)
    torch.testing.assert_close(on_policy.weights, torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))


def test_combine_multiplies_weights_and_prefixes_metrics():
    logprobs, behaviour = batch_with_ratios([[1.0, 1.0, 1.0], [2.0, 0.5, 1.0]])
    decayed = compute("age_decay", logprobs, behaviour, age=torch.tensor([1, 0]), decay=0.5)
    filtered = compute("kl_filter", logprobs, behaviour, max_kl=0.1)  # row 1 has KL 0.25 → dropped
    combined = combine_weights(decayed, filtered, mask=MASK)
    torch.testing.assert_close(combined.weights, torch.tensor([[0.5, 0.5, 0.5], [0.0, 0.0, 0.0]]))
    assert combined.metrics["fraction_dropped"].item() == pytest.approx(2 / 5)
    assert combined.metrics["fraction_downweighted"].item() == pytest.approx(3 / 5)
    assert combined.metrics["ess"].item() == pytest.approx(1.5**2 / (5 * 0.75))
    assert combined.metrics["kl_filter/kl_mean"].item() == pytest.approx(0.125, rel=1e-5)
    assert "age_decay/ess" in combined.metrics and "kl_filter/fraction_dropped" in combined.metrics
    with pytest.raises(ValueError, match="at least one"):
        combine_weights(mask=MASK)


def test_ess_is_zero_when_everything_is_dropped():
    metrics = weight_metrics(torch.zeros(2, 3), MASK)
    assert metrics["ess"].item() == 0.0 and metrics["fraction_dropped"].item() == 1.0


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("truncated_is", {"truncation": 0.0}, "truncation"),
        ("truncated_is", {"level": "trajectory"}, "'token' or 'sequence'"),
        ("age_decay", {"age": torch.tensor([0, 1]), "decay": 0.0}, r"\(0, 1\]"),
        ("age_decay", {"age": torch.tensor([0, 1]), "decay": 1.5}, r"\(0, 1\]"),
        ("age_decay", {}, "needs `age`"),
        ("age_decay", {"age": torch.tensor([0, -1])}, "age must be ≥ 0"),
        ("age_decay", {"age": torch.tensor([0, 1, 2])}, "expected"),
        ("kl_filter", {"max_kl": 0.0}, "max_kl"),
        ("kl_filter", {"mode": "clip"}, "'drop' or 'downweight'"),
        ("version_window", {"age": torch.tensor([0, 1])}, "needs `window`"),
        ("version_window", {"age": torch.tensor([0, 1]), "window": -1}, "window"),
    ],
)
def test_invalid_hyperparameters_say_what_to_fix(name, kwargs, message):
    logprobs, behaviour = batch_with_ratios([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    with pytest.raises(ValueError, match=message):
        compute(name, logprobs, behaviour, **kwargs)


def test_mismatched_shapes_are_rejected():
    logprobs, behaviour = batch_with_ratios([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    with pytest.raises(ValueError, match="same"):
        compute("none", logprobs, behaviour[:, :2])


def test_engine_mismatch_gives_k3_and_max_ratio_as_computed_by_hand():
    # r = π_trainer/μ_engine = (1.8, 0.5, 1, e²) on the masked tokens; the last column is off the mask
    trainer = torch.log(torch.tensor([[0.36, 0.1, 0.3, 0.9], [math.exp(-1.0), 0.5, 0.5, 0.5]]))
    engine = torch.log(torch.tensor([[0.2, 0.2, 0.3, 0.1], [math.exp(-3.0), 0.5, 0.5, 0.5]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    out = engine_mismatch_weights(trainer, engine, mask, cap=2.0)
    ratios = [1.8, 0.5, 1.0, math.exp(2.0)]
    k3 = sum((r - 1) - math.log(r) for r in ratios) / 4  # Schulman's k3 of KL(μ_engine‖π_trainer)
    assert float(out.metrics["k3"]) == pytest.approx(k3, rel=1e-5)
    assert float(out.metrics["max_ratio"]) == pytest.approx(math.exp(2.0), rel=1e-5)
    assert float(out.metrics["fraction_capped"]) == pytest.approx(1 / 4)  # only e² is above the cap
    expected = torch.tensor([[1.8, 0.5, 1.0, 0.0], [2.0, 0.0, 0.0, 0.0]])  # min(r, cap), 0 off the mask
    assert torch.allclose(out.weights, expected, atol=1e-6) and not out.weights.requires_grad


def test_engine_mismatch_is_zero_and_weight_one_when_the_log_probs_agree():
    logprobs = torch.log(torch.tensor([[0.3, 0.6]]))
    out = engine_mismatch_weights(logprobs, logprobs.clone(), torch.ones(1, 2), cap=1.5)
    assert float(out.metrics["k3"]) == 0.0 and float(out.metrics["max_ratio"]) == 1.0
    assert torch.equal(out.weights, torch.ones(1, 2)) and float(out.metrics["fraction_capped"]) == 0.0
    with pytest.raises(ValueError, match=r"cap \(0.0\) must be > 0"):
        engine_mismatch_weights(logprobs, logprobs, torch.ones(1, 2), cap=0.0)
