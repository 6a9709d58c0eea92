"""The optimal token baseline: Σπ² from logits, a hand example of the energy-weighted per-position baseline, its
limit (equal energies: the group mean of the reward-to-go) and a plain-loop twin."""

import pytest
import torch

from unipg.estimate import ADVANTAGES, advantage_family
from unipg.estimate.advantages import dr_grpo_advantages
from unipg.estimate.token_baselines import optimal_token_baseline_advantages, sum_of_squared_probabilities


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def test_sum_of_squared_probabilities_matches_softmax_and_stays_finite():
    logits = t([[2.0, 0.0, -1.0], [1000.0, 1000.0, -1000.0]])
    expected = (torch.softmax(logits, -1) ** 2).sum(-1)
    assert torch.allclose(sum_of_squared_probabilities(logits), expected)
    assert sum_of_squared_probabilities(logits)[1].item() == pytest.approx(0.5)


def test_hand_example_energy_weighted_baseline_per_position():
    # group 7: row 0 (2 tokens) π = S = 0.5 → w = 1 − 1 + 0.5 = 0.5, W = (0.5, 1.0), rewards (0, 1) → G = (1, 1)
    #          row 2 (3 tokens) π = S = 0.25 → w = 0.75, W = (0.75, 1.5, 2.25), rewards (0, 0, 2) → G = (2, 2, 2)
    # b_0 = (1·0.5 + 2·0.75) / 1.25 = 1.6, b_1 = (1·1 + 2·1.5) / 2.5 = 1.6, b_2 = 0 (row 2 alone reaches it)
    # group 3: row 1 alone → baseline 0, A = G
    rewards = t([[0.0, 1.0, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 2.0]])
    mask = t([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    probability = t([[0.5, 0.5, 0.0], [0.9, 0.0, 0.0], [0.25, 0.25, 0.25]])
    sum_pi_squared = t([[0.5, 0.5, 0.0], [0.81, 0.0, 0.0], [0.25, 0.25, 0.25]])
    advantages, returns = optimal_token_baseline_advantages(
        rewards, mask, probability.log(), sum_pi_squared, torch.tensor([7, 3, 7]), eps=0.0
    )
    assert torch.allclose(returns, t([[1.0, 1.0, 0.0], [0.5, 0.0, 0.0], [2.0, 2.0, 2.0]]))
    assert torch.allclose(advantages, t([[-0.6, -0.6, 0.0], [0.5, 0.0, 0.0], [0.4, 0.4, 2.0]]))


def test_equal_energies_give_the_group_mean_dr_grpo_on_equal_lengths():
    generator = torch.Generator().manual_seed(0)
    scores = torch.rand(8, generator=generator, dtype=torch.float64)
    rewards = torch.zeros(8, 5, dtype=torch.float64)
    rewards[:, -1] = scores  # the sequence reward on the last token, every response 5 tokens long
    advantages, _ = optimal_token_baseline_advantages(
        rewards,
        torch.ones(8, 5),
        torch.full((8, 5), -1.0, dtype=torch.float64),
        torch.full((8, 5), 0.3, dtype=torch.float64),
        torch.arange(8) // 4,
        eps=0.0,
    )
    assert torch.allclose(advantages, dr_grpo_advantages(scores, group_size=4)[:, None].expand(8, 5))


def loop_twin(rewards, mask, behaviour_logprobs, sum_pi_squared, group_index):
    rows, width = rewards.shape
    returns = torch.zeros_like(rewards)
    energy = torch.zeros_like(rewards)
    for i in range(rows):
        running_return, running_energy = 0.0, 0.0
        for k in reversed(range(width)):
            running_return += float(rewards[i, k] * mask[i, k])
            returns[i, k] = running_return * mask[i, k]
        for k in range(width):
            if mask[i, k]:
                running_energy += 1 - 2 * float(behaviour_logprobs[i, k].exp()) + float(sum_pi_squared[i, k])
                energy[i, k] = running_energy
    advantages = torch.zeros_like(rewards)
    for i in range(rows):
        peers = [j for j in range(rows) if group_index[j] == group_index[i]]
        for k in range(width):
            if not mask[i, k]:
                continue
            reaching = [j for j in peers if mask[j, k]]
            baseline = 0.0
            if len(reaching) > 1:
                weight = sum(float(energy[j, k]) for j in reaching)
                baseline = sum(float(returns[j, k] * energy[j, k]) for j in reaching) / (weight + 1e-8)
            advantages[i, k] = returns[i, k] - baseline
    return advantages, returns


def test_vectorised_matches_a_plain_loop():
    generator = torch.Generator().manual_seed(1)
    rewards = torch.randn(9, 6, generator=generator, dtype=torch.float64)
    lengths = torch.randint(1, 7, (9,), generator=generator)
    mask = (torch.arange(6)[None, :] < lengths[:, None]).double()
    logits = torch.randn(9, 6, 5, generator=generator, dtype=torch.float64)
    behaviour = torch.log_softmax(logits, -1)[..., 0]
    sum_pi_squared = sum_of_squared_probabilities(logits)
    groups = torch.tensor([0, 0, 0, 2, 2, 2, 1, 1, 1])
    got = optimal_token_baseline_advantages(rewards, mask, behaviour, sum_pi_squared, groups)
    expected = loop_twin(rewards, mask, behaviour, sum_pi_squared, groups)
    assert torch.allclose(got[0], expected[0]) and torch.allclose(got[1], expected[1])


def test_registered_as_a_token_level_estimator_without_a_critic():
    entry = ADVANTAGES.entry("optimal_token_baseline")
    assert advantage_family("optimal_token_baseline") == "step" and "values" not in entry.inputs
    assert {"sum_pi_squared", "group_index"} <= set(entry.inputs)
