"""TR-DPO's soft update of the reference, θ_ref ← α θ + (1 − α) θ_ref: a hand example and its limits."""

import pytest
import torch

from unipg.estimate.reference_sync import soft_update_reference


def test_soft_update_hand_example_in_place():
    reference = [torch.tensor([1.0, 2.0]), torch.tensor([[0.0]])]
    policy = [torch.tensor([3.0, -2.0]), torch.tensor([[4.0]])]
    soft_update_reference(reference, policy, alpha=0.25)
    # 0.25 · 3 + 0.75 · 1 = 1.5, 0.25 · (−2) + 0.75 · 2 = 1, 0.25 · 4 + 0 = 1
    assert torch.equal(reference[0], torch.tensor([1.5, 1.0])) and torch.equal(reference[1], torch.tensor([[1.0]]))
    assert torch.equal(policy[0], torch.tensor([3.0, -2.0]))  # the policy is read, never written


def test_alpha_one_copies_the_policy_and_a_bfloat16_reference_reads_float32_weights():
    reference = [torch.zeros(3, dtype=torch.bfloat16)]
    policy = [torch.tensor([0.5, -1.25, 2.0])]
    soft_update_reference(reference, policy, alpha=1.0)
    assert reference[0].dtype == torch.bfloat16 and torch.equal(reference[0].float(), policy[0])


@pytest.mark.parametrize(
    ("reference", "policy", "alpha", "problem"),
    [
        ([torch.zeros(2)], [torch.zeros(2)], 0.0, r"must lie in \(0, 1\]"),
        ([torch.zeros(2)], [torch.zeros(2)], 1.5, r"must lie in \(0, 1\]"),
        ([torch.zeros(2)], [torch.zeros(2), torch.zeros(1)], 0.5, "not one architecture"),
        ([torch.zeros(2)], [torch.zeros(3)], 0.5, "shape"),
    ],
)
def test_bad_arguments_say_what_is_wrong(reference, policy, alpha, problem):
    with pytest.raises(ValueError, match=problem):
        soft_update_reference(reference, policy, alpha=alpha)
