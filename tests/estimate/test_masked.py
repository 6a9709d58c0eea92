"""Masked reductions and selections."""

import pytest
import torch

from unipg.estimate.masked import masked_mean, masked_sum, top_fraction_mask


def test_top_fraction_keeps_the_largest_valid_entries_at_least_one():
    values = torch.tensor([[5.0, 1.0, 3.0], [9.0, 2.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0]])  # 9.0 is padding and is never picked
    assert torch.equal(top_fraction_mask(values, mask, 0.5), torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]]))
    assert torch.equal(top_fraction_mask(values, mask, 0.01), torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert top_fraction_mask(values, mask, 1.0) is mask
    assert top_fraction_mask(values, torch.zeros_like(mask), 0.5).sum() == 0


def test_top_fraction_rejects_a_fraction_outside_zero_one():
    with pytest.raises(ValueError, match="fraction"):
        top_fraction_mask(torch.zeros(1, 1), torch.ones(1, 1), 0.0)


def test_no_mask_is_every_entry_valid():
    values = torch.tensor([[1.0, 2.0], [3.0, 5.0]])
    ones = torch.ones_like(values)
    assert torch.equal(masked_mean(values, None), masked_mean(values, ones))
    assert torch.equal(masked_mean(values, None, dim=-1), masked_mean(values, ones, dim=-1))
    assert torch.equal(masked_sum(values, None), masked_sum(values, ones))
