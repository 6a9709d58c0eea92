import pytest
import torch

from unipg.learn.common import clip_grad_norm, shuffled_minibatches


def test_clip_grad_norm_returns_the_pre_clip_norm_and_clips_to_the_limit():
    a, b = torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)
    a.grad, b.grad = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, 4.0])
    assert clip_grad_norm([a, b], 1.0) == pytest.approx(5.0)
    assert torch.linalg.vector_norm(torch.cat([a.grad, b.grad])).item() == pytest.approx(1.0, rel=1e-5)
    assert clip_grad_norm([a, b], 10.0) == pytest.approx(1.0, rel=1e-5)  # below the limit: untouched
    assert torch.linalg.vector_norm(torch.cat([a.grad, b.grad])).item() == pytest.approx(1.0, rel=1e-5)
    assert clip_grad_norm([a, b], None) == pytest.approx(1.0, rel=1e-5)


def test_clip_grad_norm_without_gradients_is_zero():
    assert clip_grad_norm([torch.zeros(2, requires_grad=True)], 1.0) == 0.0


def test_minibatches_cover_every_valid_sample_once_per_epoch_with_a_smaller_last_one():
    valid = torch.tensor([0, 2, 3, 5, 7, 8, 9, 11, 12, 13])  # 10 valid samples of a masked batch
    batches = list(shuffled_minibatches(valid, 4, epochs=2, generator=torch.Generator().manual_seed(0)))
    assert [len(b) for b in batches] == [4, 4, 2, 4, 4, 2]
    assert sorted(torch.cat(batches[:3]).tolist()) == valid.tolist()
    assert sorted(torch.cat(batches[3:]).tolist()) == valid.tolist()
