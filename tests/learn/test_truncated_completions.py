"""estimator.mask_truncated_completions: cut completions leave the loss, not their group's baseline."""

import torch

from tests.helpers.batches import make_batch, make_config
from unipg.learn.lm import LMLearner
from unipg.learn.lm_batch import LMBatch
from unipg.policy.generation import Generation


def test_a_generation_cut_at_its_token_limit_is_marked_truncated():
    mask = torch.ones(2, 3)
    generation = Generation(
        prompt_ids=torch.zeros(2, 1, dtype=torch.long),
        prompt_mask=torch.ones(2, 1, dtype=torch.long),
        completion_ids=torch.zeros(2, 3, dtype=torch.long),
        completion_mask=mask,
        behaviour_logprobs=torch.zeros(2, 3),
        texts=["a", "b"],
        finish_reasons=["stop", "length"],
    )
    batch = LMBatch.from_generation(generation, [1.0, 0.0])
    assert batch.truncated.tolist() == [False, True]
    assert torch.equal(batch.loss_mask(False), mask)
    assert torch.equal(batch.loss_mask(True), torch.tensor([[1.0] * 3, [0.0] * 3]))


def update(policy, mask_truncated: bool, truncated: torch.Tensor) -> dict:
    config = make_config("grpo", f"estimator.mask_truncated_completions={str(mask_truncated).lower()}")
    learner = LMLearner(policy, config)
    batch = make_batch(policy)
    batch.truncated = truncated
    learner.prepare(batch)
    return batch, learner.update(batch)


def test_masked_rows_pass_no_gradient_but_keep_their_advantages(tiny_policy, one_torch_thread):
    policy = tiny_policy()
    before = [parameter.detach().clone() for parameter in policy.model.parameters()]
    every_row = torch.ones(16, dtype=torch.bool)
    batch, metrics = update(policy, True, every_row)
    assert metrics["grad_norm"] == 0.0 and metrics["policy_loss"] == 0.0
    assert all(torch.equal(old, new) for old, new in zip(before, policy.model.parameters()))
    assert bool((batch.advantages != 0).any())  # the group baseline saw every score
    _, unmasked = update(policy, False, every_row)
    assert unmasked["grad_norm"] > 0


def test_with_nothing_cut_the_option_changes_nothing(tiny_policy, one_torch_thread):
    none_cut = torch.zeros(16, dtype=torch.bool)
    _, masked = update(tiny_policy(), True, none_cut)
    _, unmasked = update(tiny_policy(), False, none_cut)
    assert masked["policy_loss"] == unmasked["policy_loss"] and masked["grad_norm"] == unmasked["grad_norm"]


def test_an_episode_whose_last_turn_hit_its_token_budget_is_cut_even_when_graded():
    """A single-turn answer stopped at sample.max_new_tokens and then graded finishes "done"; it is still cut."""
    from unipg.sample.agent import Trajectory
    from unipg.tasks.base import Example

    def episode(finish: str, cut: bool) -> Trajectory:
        trajectory = Trajectory(Example("q", "1", "1"), [5, 6], finish=finish, cut=cut)
        trajectory.add_sampled([7, 8], [-0.1, -0.2], 0)
        trajectory.step_rewards.append(0.0)
        return trajectory

    episodes = [episode("done", False), episode("done", True), episode("max_tokens", False)]
    batch = LMBatch.from_trajectories(episodes, pad_id=0)
    assert batch.truncated.tolist() == [False, True, True]
