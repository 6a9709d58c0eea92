"""Group advantages are computed over episodes told apart by the rows' explicit episode and group index."""

import pytest
import torch

from unipg.config import load_config
from unipg.estimate import ADVANTAGES
from unipg.estimate.advantages import broadcast_to_tokens
from unipg.learn.lm_batch import LMBatch, lm_advantages, token_rewards

SCORES = [1.0, 0.0, 0.5, 0.25, 2.0, -1.0, 0.0, 3.0]  # two groups of four episodes
GROUP_ESTIMATORS = ["grpo", "dr_grpo", "rloo", "turn_level"]


def estimator(name):
    return load_config(
        None, ["task.name=arithmetic", f"estimator.advantage={name}", "estimator.normalize_advantages=false"]
    ).estimator


def batch_of(scores, lengths, **fields):
    """One single-turn row per score, ``lengths[i]`` sampled tokens each."""
    width = max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths])
    turns = torch.where(mask > 0, 0, -1)
    return LMBatch(
        input_ids=torch.zeros((len(scores), width + 1), dtype=torch.long),
        attention_mask=torch.ones((len(scores), width + 1), dtype=torch.long),
        completion_mask=mask,
        behaviour_logprobs=torch.zeros_like(mask),
        scores=torch.tensor(scores),
        token_turns=turns,
        turn_rewards=torch.tensor(scores)[:, None],
        turn_mask=torch.ones((len(scores), 1)),
        **fields,
    )


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_one_row_per_episode_in_consecutive_groups_is_the_estimator_on_the_scores_bit_for_bit(name):
    lengths = [3, 1, 2, 4, 2, 2, 1, 3]
    before = lm_advantages(batch_of(SCORES, lengths), estimator(name), group_size=4, kl_coef=0.0)[0]
    indexed = batch_of(SCORES, lengths, episodes=torch.arange(8), groups=torch.tensor([0] * 4 + [1] * 4))
    after = lm_advantages(indexed, estimator(name), group_size=4, kl_coef=0.0)[0]
    assert torch.equal(before, after)
    if name != "turn_level":
        expected = ADVANTAGES.call(name, {"scores": torch.tensor(SCORES), "group_size": 4}, estimator(name))
        assert torch.equal(after, broadcast_to_tokens(expected, indexed.completion_mask))


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_groups_are_read_from_the_index_not_from_positions(name):
    interleaved = [0, 4, 1, 5, 2, 6, 3, 7]  # episodes of the two groups alternate in the batch
    scores = [SCORES[i] for i in interleaved]
    batch = batch_of(scores, [2] * 8, episodes=torch.arange(8), groups=torch.tensor([0, 1] * 4))
    advantages = lm_advantages(batch, estimator(name), group_size=4, kl_coef=0.0)[0][:, 0]
    consecutive = lm_advantages(batch_of(SCORES, [2] * 8), estimator(name), group_size=4, kl_coef=0.0)[0][:, 0]
    assert torch.equal(advantages, consecutive[interleaved])


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_the_rows_of_one_episode_share_its_advantage_and_count_once_in_its_group(name):
    # episode 1 trained three trajectories (its own, then two more); episode 5 two
    episodes = [0, 1, 1, 1, 2, 3, 4, 5, 5, 6, 7]
    scores = [SCORES[e] for e in episodes]
    batch = batch_of(
        scores,
        [2, 3, 1, 4, 2, 2, 2, 1, 5, 2, 2],
        episodes=torch.tensor(episodes),
        groups=torch.tensor([e // 4 for e in episodes]),
    )
    advantages = lm_advantages(batch, estimator(name), group_size=4, kl_coef=0.0)[0]
    one_row_each = lm_advantages(batch_of(SCORES, [2] * 8), estimator(name), group_size=4, kl_coef=0.0)[0][:, 0]
    for row, episode in enumerate(episodes):
        sampled = advantages[row][batch.completion_mask[row] == 1]
        assert torch.equal(sampled, torch.full_like(sampled, float(one_row_each[episode])))


def test_an_episodes_first_row_scores_it():
    batch = batch_of([1.0, 5.0, 0.0], [1, 1, 1], episodes=torch.tensor([0, 0, 1]), groups=torch.tensor([0, 0, 0]))
    advantages = lm_advantages(batch, estimator("dr_grpo"), group_size=2, kl_coef=0.0)[0][:, 0]
    assert advantages.tolist() == [0.5, 0.5, -0.5]
    assert token_rewards(batch, None, 0.0).sum(1).tolist() == [1.0, 5.0, 0.0]  # token estimators: each its own


def test_a_group_without_samples_per_prompt_episodes_is_refused():
    batch = batch_of([1.0, 0.0, 2.0], [1, 1, 1], episodes=torch.arange(3), groups=torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match=r"a group holds 1 episodes.*samples_per_prompt \(2\)"):
        lm_advantages(batch, estimator("grpo"), group_size=2, kl_coef=0.0)
