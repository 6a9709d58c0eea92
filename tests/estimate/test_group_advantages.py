"""OPO, grpo_passk, REINFORCE++-baseline, GPG and ReMax: hand examples, loop twins, and where they reduce to known ones."""

import pytest
import torch

from unipg.estimate import ADVANTAGES, advantage_family, needs_greedy_baseline
from unipg.estimate.advantages import dr_grpo_advantages
from unipg.estimate.group_advantages import (
    gpg_advantages,
    grpo_passk_advantages,
    opo_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
)


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_opo_baseline_is_the_length_weighted_group_mean():
    scores, lengths = t([1, 0, 0, 1]), t([3, 1, 2, 2])  # two groups of two
    # group 0: b = (3·1 + 1·0) / 4 = 0.75; group 1: b = (2·0 + 2·1) / 4 = 0.5
    assert torch.allclose(opo_advantages(scores, lengths, group_size=2), t([0.25, -0.75, -0.5, 0.5]))


def test_opo_with_equal_lengths_is_dr_grpo():
    generator = torch.Generator().manual_seed(0)
    scores = torch.rand(12, generator=generator, dtype=torch.float64)
    got = opo_advantages(scores, torch.full((12,), 7), group_size=4)
    assert torch.allclose(got, dr_grpo_advantages(scores, group_size=4))


def test_opo_group_of_empty_responses_uses_the_plain_mean():
    assert torch.allclose(opo_advantages(t([1, 0]), t([0, 0]), group_size=2), t([0.5, -0.5]))


def test_grpo_passk_credits_only_the_best_sample_by_its_margin():
    scores = t([0.2, 1.0, 0.5, 1.0, 1.0, 0.0])  # two groups of three; group 1 ties at the top
    std0, std1 = scores[:3].std().item(), scores[3:].std().item()
    expected = t([0.0, 0.5 / (std0 + 1e-6), 0.0, 0.0, 0.0, 0.0])  # a tie has no margin
    assert torch.allclose(grpo_passk_advantages(scores, group_size=3), expected)
    assert std1 > 0


def loop_reinforce_pp_baseline(scores, lengths, group_size):
    """Slow twin: centre in groups, broadcast to tokens, whiten over every token (Bessel-corrected)."""
    centred = []
    for start in range(0, len(scores), group_size):
        group = scores[start : start + group_size]
        centred += [float(score - group.mean()) for score in group]
    tokens = torch.tensor([a for a, n in zip(centred, lengths) for _ in range(int(n))], dtype=torch.float64)
    return (torch.tensor(centred, dtype=torch.float64) - tokens.mean()) / tokens.std()


def test_reinforce_plus_plus_baseline_equals_token_level_whitening():
    generator = torch.Generator().manual_seed(1)
    scores = torch.rand(8, generator=generator, dtype=torch.float64)
    lengths = torch.randint(1, 6, (8,), generator=generator)
    got = reinforce_plus_plus_baseline_advantages(scores, lengths, group_size=4, eps=0.0)
    assert torch.allclose(got, loop_reinforce_pp_baseline(scores, lengths, 4))


def test_gpg_rescales_by_the_share_of_informative_samples():
    scores = t([1, 0, 1, 1, 0, 0])  # groups of two: only the first one disagrees → α = 6 / 2 = 3
    assert torch.allclose(gpg_advantages(scores, group_size=2), t([1.5, -1.5, 0, 0, 0, 0]))
    assert torch.allclose(gpg_advantages(t([1, 1]), group_size=2), t([0, 0]))  # nothing informative: α = 1


def test_remax_is_the_score_minus_the_greedy_responses_score():
    scores, greedy = t([1.0, 0.0, 0.5, 0.5]), t([0.0, 0.0, 1.0, 1.0])  # the last two: samples of one prompt
    assert torch.equal(remax_advantages(scores, greedy), t([1.0, 0.0, -0.5, -0.5]))


def test_remax_gives_no_advantage_to_a_sample_that_scores_as_the_greedy_response():
    generator = torch.Generator().manual_seed(2)
    scores = torch.rand(9, generator=generator, dtype=torch.float64)
    assert torch.equal(remax_advantages(scores, scores.clone()), torch.zeros(9, dtype=torch.float64))


def test_remax_needs_one_greedy_score_per_sample():
    with pytest.raises(ValueError, match="one greedy score per sample"):
        remax_advantages(t([1.0, 0.0]), t([1.0]))


@pytest.mark.parametrize("name", ["opo", "grpo_passk", "reinforce_plus_plus_baseline", "gpg", "remax"])
def test_new_estimators_are_group_estimators(name):
    assert advantage_family(name) == "group"
    assert name in ADVANTAGES
    assert needs_greedy_baseline(name) == (name == "remax")
    # ReMax reads no group size: its baseline is the greedy response, so one sample per prompt is enough
    assert ("group_size" in ADVANTAGES.entry(name).inputs) == (name != "remax")
