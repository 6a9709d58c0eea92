"""Advantage estimators: hand-computed examples, loop twins, identities between estimators, groups."""

from __future__ import annotations

import pytest
import torch

from unipg.estimate.advantages import (
    ADVANTAGES,
    advantage_family,
    advantage_names,
    batch_mean_baseline_advantages,
    broadcast_to_tokens,
    dr_grpo_advantages,
    gae,
    group_normalized_advantages,
    needs_critic,
    normalize_advantages,
    reinforce_plus_plus_advantages,
    reward_to_go,
    reward_to_go_advantages,
    rloo_advantages,
    td_advantages,
    td_residuals,
    value_baseline_advantages,
)
from unipg.registry import RegistryError


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# ------------------------------------------------------------------------------------------------
# Plain-python loop twins: one scalar at a time, straight from the recursions.


def reward_to_go_loop(rewards, dones, gamma, bootstrap):
    batch, horizon = len(rewards), len(rewards[0])
    out = [[0.0] * horizon for _ in range(batch)]
    for b in range(batch):
        running = bootstrap[b]
        for step in reversed(range(horizon)):
            running = rewards[b][step] + gamma * (1.0 - dones[b][step]) * running
            out[b][step] = running
    return out


def gae_loop(rewards, values, dones, gamma, lam, bootstrap):
    batch, horizon = len(rewards), len(rewards[0])
    out = [[0.0] * horizon for _ in range(batch)]
    for b in range(batch):
        next_advantage = 0.0
        for step in reversed(range(horizon)):
            next_value = bootstrap[b] if step == horizon - 1 else values[b][step + 1]
            not_done = 1.0 - dones[b][step]
            delta = rewards[b][step] + gamma * not_done * next_value - values[b][step]
            next_advantage = delta + gamma * lam * not_done * next_advantage
            out[b][step] = next_advantage
    return out


def random_episode_batch(seed: int, batch: int = 5, horizon: int = 17):
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, horizon, generator=generator, dtype=torch.float64)
    values = torch.randn(batch, horizon, generator=generator, dtype=torch.float64)
    dones = torch.rand(batch, horizon, generator=generator) < 0.3
    bootstrap = torch.randn(batch, generator=generator, dtype=torch.float64)
    return rewards, values, dones, bootstrap


# ------------------------------------------------------------------------------------------------
# Hand-computed examples (γ = 0.5)


def test_reward_to_go_hand_example_without_and_with_bootstrap():
    rewards, dones = t([[1, 2, 3]]), t([[0, 0, 0]])
    # G2 = 3, G1 = 2 + 0.5·3, G0 = 1 + 0.5·3.5
    assert torch.allclose(reward_to_go(rewards, dones, gamma=0.5), t([[2.75, 3.5, 3.0]]))
    # the bootstrap V = 4 enters after the last step: G2 = 3 + 0.5·4 = 5
    got = reward_to_go(rewards, dones, gamma=0.5, bootstrap_value=t([4]))
    assert torch.allclose(got, t([[3.25, 4.5, 5.0]]))


def test_reward_to_go_does_not_flow_across_done():
    rewards, dones = t([[1, 2, 3]]), torch.tensor([[False, True, False]])
    # G2 = 3 + 0.5·4; G1 = 2 (episode ended); G0 = 1 + 0.5·2
    got = reward_to_go(rewards, dones, gamma=0.5, bootstrap_value=t([4]))
    assert torch.allclose(got, t([[2.0, 2.0, 5.0]]))


def test_bootstrap_is_ignored_when_last_step_is_done():
    rewards, dones = t([[1, 2, 3]]), t([[0, 0, 1]])
    with_bootstrap = reward_to_go(rewards, dones, gamma=0.5, bootstrap_value=t([100]))
    assert torch.allclose(with_bootstrap, reward_to_go(rewards, dones, gamma=0.5))


def test_td_residuals_and_gae_hand_example():
    rewards, values, dones = t([[1, 2, 3]]), t([[1, 1, 2]]), t([[0, 1, 0]])
    bootstrap = t([4])
    # δ0 = 1 + 0.5·1 − 1, δ1 = 2 − 1 (done), δ2 = 3 + 0.5·4 − 2
    deltas = td_residuals(rewards, values, dones, gamma=0.5, bootstrap_value=bootstrap)
    assert torch.allclose(deltas, t([[0.5, 1.0, 3.0]]))
    # γλ = 0.25: A2 = 3, A1 = 1 (done), A0 = 0.5 + 0.25·1
    advantages, returns = gae(rewards, values, dones, gamma=0.5, lam=0.5, bootstrap_value=bootstrap)
    assert torch.allclose(advantages, t([[0.75, 1.0, 3.0]]))
    assert torch.allclose(returns, t([[1.75, 2.0, 5.0]]))


def test_batch_mean_baseline_hand_example_with_padding():
    # row 0 ends at t=2, row 1 ends at t=1 and t=2 is padding
    rewards, dones = t([[1, 0, 0], [0, 2, 0]]), t([[0, 0, 1], [0, 1, 0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    advantages, returns = batch_mean_baseline_advantages(rewards, dones, mask, gamma=1.0)
    assert torch.allclose(returns, t([[1, 0, 0], [2, 2, 0]]))
    # mean of the valid returns (1 + 0 + 0 + 2 + 2) / 5 = 1; padding stays 0
    assert torch.allclose(advantages, t([[0, -1, -1], [1, 1, 0]]))


def test_value_baseline_hand_example():
    rewards, values, dones = t([[1, 2, 3]]), t([[1, 1, 2]]), t([[0, 0, 1]])
    advantages, returns = value_baseline_advantages(rewards, values, dones, gamma=0.5)
    assert torch.allclose(returns, t([[2.75, 3.5, 3.0]]))
    assert torch.allclose(advantages, t([[1.75, 2.5, 1.0]]))


def test_reward_to_go_estimator_returns_g_as_advantage():
    rewards, dones = t([[1, 2, 3]]), t([[0, 0, 0]])
    advantages, returns = reward_to_go_advantages(rewards, dones, gamma=0.5)
    assert torch.allclose(advantages, t([[2.75, 3.5, 3.0]]))
    assert torch.equal(advantages, returns)


def test_reinforce_plus_plus_hand_example_skips_masked_tokens_when_discounting():
    rewards = t([[0, 0, 1], [0, 1, 0]])
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])  # row 0: a tool token at t=1; row 1: padding at t=2
    advantages, returns = reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    # row 0: t=1 is not a policy token, so t=0 is one discount step from the reward at t=2
    assert torch.allclose(returns, t([[0.5, 0, 1], [0.5, 1, 0]]))
    # valid returns 0.5, 1, 0.5, 1: mean 0.75, unbiased std sqrt(1/12)
    z = 0.25 / (1 / 12) ** 0.5
    assert torch.allclose(advantages, t([[-z, 0, z], [-z, z, 0]]), atol=1e-6)


# ------------------------------------------------------------------------------------------------
# Loop twins and identities on random batches with random episode ends


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reward_to_go_matches_loop_twin(seed):
    rewards, _, dones, bootstrap = random_episode_batch(seed)
    expected = reward_to_go_loop(rewards.tolist(), dones.double().tolist(), 0.9, bootstrap.tolist())
    got = reward_to_go(rewards, dones, gamma=0.9, bootstrap_value=bootstrap)
    assert torch.allclose(got, t(expected))


@pytest.mark.parametrize("seed, gamma, lam", [(0, 0.99, 0.95), (1, 0.9, 0.5), (2, 1.0, 1.0)])
def test_gae_matches_loop_twin(seed, gamma, lam):
    rewards, values, dones, bootstrap = random_episode_batch(seed)
    expected = gae_loop(rewards.tolist(), values.tolist(), dones.double().tolist(), gamma, lam, bootstrap.tolist())
    advantages, returns = gae(rewards, values, dones, gamma=gamma, lam=lam, bootstrap_value=bootstrap)
    assert torch.allclose(advantages, t(expected))
    assert torch.allclose(returns, advantages + values)


def test_gae_lambda_one_is_reward_to_go_minus_values():
    rewards, values, dones, bootstrap = random_episode_batch(3)
    advantages, _ = gae(rewards, values, dones, gamma=0.97, lam=1.0, bootstrap_value=bootstrap)
    expected = reward_to_go(rewards, dones, gamma=0.97, bootstrap_value=bootstrap) - values
    assert torch.allclose(advantages, expected)


def test_gae_lambda_zero_is_td_residual_and_td_estimator():
    rewards, values, dones, bootstrap = random_episode_batch(4)
    advantages, returns = gae(rewards, values, dones, gamma=0.97, lam=0.0, bootstrap_value=bootstrap)
    deltas = td_residuals(rewards, values, dones, gamma=0.97, bootstrap_value=bootstrap)
    assert torch.allclose(advantages, deltas)
    td_adv, td_returns = td_advantages(rewards, values, dones, gamma=0.97, bootstrap_value=bootstrap)
    assert torch.allclose(td_adv, advantages) and torch.allclose(td_returns, returns)


def test_gae_accepts_float32_and_bool_dones():
    rewards, values, dones, bootstrap = random_episode_batch(5)
    advantages, _ = gae(rewards.float(), values.float(), dones, gamma=0.9, lam=0.9, bootstrap_value=bootstrap.float())
    reference, _ = gae(rewards, values, dones.double(), gamma=0.9, lam=0.9, bootstrap_value=bootstrap)
    assert advantages.dtype == torch.float32
    assert torch.allclose(advantages.double(), reference, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# Group estimators


def test_grpo_hand_example_with_and_without_std():
    scores = t([1, 0, 0, 1, 1, 1, 1, 1])  # two prompts, four samples each
    # group 0: mean 0.5, unbiased std sqrt(1/3) → ±0.5·sqrt(3); group 1: all equal → 0, not NaN
    z = 0.5 * 3**0.5
    got = group_normalized_advantages(scores, group_size=4)
    assert torch.allclose(got, t([z, -z, -z, z, 0, 0, 0, 0]), atol=1e-5)
    unscaled = group_normalized_advantages(scores, group_size=4, scale="none")
    assert torch.allclose(unscaled, t([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    assert torch.allclose(dr_grpo_advantages(scores, group_size=4), unscaled)


def test_grpo_batch_scale_divides_by_the_std_of_every_score():
    scores = t([1, 0, 0, 1, 1, 1, 1, 1])
    # centred within groups as before; σ = unbiased std of all 8 scores: mean 0.75, Σ(r − 0.75)² = 1.5 → sqrt(1.5/7)
    sigma = (1.5 / 7) ** 0.5
    got = group_normalized_advantages(scores, group_size=4, scale="batch", eps=0.0)
    assert torch.allclose(got, t([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]) / sigma)


def test_grpo_eps_and_unknown_scale():
    scores = t([1, 0, 1, 0])  # group std sqrt(1/3)
    got = group_normalized_advantages(scores, group_size=4, eps=1.0)
    assert torch.allclose(got, t([0.5, -0.5, 0.5, -0.5]) / (3**-0.5 + 1.0))
    with pytest.raises(ValueError, match="valid: group, batch, none"):
        group_normalized_advantages(scores, group_size=4, scale="prompt")


def test_rloo_hand_example():
    scores = t([1, 2, 3, 0, 0, 4])
    # A_i = r_i − mean of the other two: 1 − 2.5, 2 − 2, 3 − 1.5 | 0 − 2, 0 − 2, 4 − 0
    got = rloo_advantages(scores, group_size=3)
    assert torch.allclose(got, t([-1.5, 0, 1.5, -2, -2, 4]))


def test_group_estimators_accept_integer_scores():
    got = rloo_advantages(torch.tensor([1, 0]), group_size=2)
    assert got.is_floating_point() and torch.allclose(got, torch.tensor([1.0, -1.0]))


@pytest.mark.parametrize("estimator", [group_normalized_advantages, dr_grpo_advantages, rloo_advantages])
def test_group_size_must_divide_number_of_samples(estimator):
    with pytest.raises(ValueError, match=r"number of samples \(10\) must be a multiple of group_size \(4\)"):
        estimator(torch.zeros(10), group_size=4)


def test_rloo_needs_two_samples_per_group():
    with pytest.raises(ValueError, match=r"group_size \(1\) must be at least 2"):
        rloo_advantages(torch.zeros(4), group_size=1)


def test_group_scores_must_be_one_dimensional():
    with pytest.raises(ValueError, match=r"shape \(N,\)"):
        group_normalized_advantages(torch.zeros(2, 4), group_size=4)


# ------------------------------------------------------------------------------------------------
# Helpers


def test_broadcast_to_tokens_repeats_on_valid_tokens_only():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    got = broadcast_to_tokens(t([2.0, -1.0]), mask)
    assert torch.equal(got, t([[2, 2, 0], [-1, 0, 0]]))


def test_normalize_advantages_whitens_valid_entries_and_keeps_signs_without_shift():
    advantages = t([[1, 2, 3], [4, 100, 100]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    whitened = normalize_advantages(advantages, mask)
    valid = whitened[mask.bool()]
    assert abs(valid.mean().item()) < 1e-9 and abs(valid.std().item() - 1.0) < 1e-6
    assert torch.all(whitened[~mask.bool()] == 0)
    scaled = normalize_advantages(advantages, mask, shift_mean=False)
    assert torch.all(scaled[mask.bool()] > 0)


# ------------------------------------------------------------------------------------------------
# Registry


def test_registered_advantage_estimators():
    expected = {
        "gae",
        "td",
        "reward_to_go",
        "batch_mean_baseline",
        "value_baseline",
        "grpo",
        "dr_grpo",
        "rloo",
        "reinforce_plus_plus",
        "turn_level",
        "opo",
        "grpo_passk",
        "reinforce_plus_plus_baseline",
        "gpg",
        "optimal_token_baseline",
        "remax",
    }
    assert set(ADVANTAGES.names()) == expected
    assert ADVANTAGES.get("gae") is gae


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(RegistryError) as error:
        ADVANTAGES.get("gea")
    message = str(error.value)
    assert "did you mean 'gae'" in message
    assert all(name in message for name in ADVANTAGES.names())


def test_duplicate_registration_is_rejected():
    with pytest.raises(RegistryError, match="already registered"):
        ADVANTAGES.register("gae")(lambda: None)
    assert ADVANTAGES.get("gae") is gae


def test_an_estimators_family_and_its_need_for_a_critic_come_from_the_inputs_it_declares(monkeypatch):
    assert advantage_names("group") == [
        "dr_grpo",
        "gpg",
        "grpo",
        "grpo_passk",
        "opo",
        "reinforce_plus_plus_baseline",
        "remax",
        "rloo",
    ]
    assert advantage_names("turn") == ["turn_level"]
    assert advantage_family("reinforce_plus_plus") == "step"
    assert [name for name in ADVANTAGES.names() if needs_critic(name)] == ["gae", "td", "value_baseline"]
    monkeypatch.setattr(ADVANTAGES, "_entries", dict(ADVANTAGES._entries))  # registration undone after the test
    ADVANTAGES.register("centered", inputs=("scores", "group_size"))(lambda scores, *, group_size: scores)
    ADVANTAGES.register("critic_turns", inputs=("turn_rewards", "values"))(lambda turn_rewards, values: values)
    assert advantage_family("centered") == "group" and not needs_critic("centered")
    assert advantage_family("critic_turns") == "turn" and needs_critic("critic_turns")
    with pytest.raises(RegistryError, match="did you mean 'grpo'"):
        advantage_family("grop")
