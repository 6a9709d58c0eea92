"""Masked reductions and selections."""

import pytest
import torch

from unipg.estimate.masked import top_fraction_mask


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
