"""bfloat16 weights are stepped through float32 masters: the optimizer's state is float32, the model's weights
are the masters rounded, and a checkpoint keeps the masters exactly."""

import torch

from tests.helpers.batches import skewed_batch, skewed_config
from unipg.learn.lm import LMLearner


def bfloat16_learner(tiny_policy) -> LMLearner:
    policy = tiny_policy(dtype="bfloat16")
    return LMLearner(
        policy, skewed_config("train.max_tokens_per_micro_batch=40", "train.num_epochs=1", "train.learning_rate=1e-5")
    )


def test_bfloat16_weights_have_float32_masters_and_optimizer_state(tiny_policy):
    learner = bfloat16_learner(tiny_policy)
    before = [p.detach().clone() for p in learner.policy.actor_parameters()]
    learner.update(skewed_batch())
    weights = learner.policy.actor_parameters()
    assert all(p.dtype == torch.bfloat16 and p.grad is None for p in weights)
    assert all(p.dtype == torch.float32 for p in learner.parameters)
    states = [learner.optimizer.state[p] for p in learner.parameters]
    assert all(s["exp_avg"].dtype == torch.float32 and s["exp_avg_sq"].dtype == torch.float32 for s in states)
    for weight, (_, master) in zip(weights, learner.masters.pairs):
        assert torch.equal(weight, master.to(torch.bfloat16))
    # a learning rate of 1e-5 moves float32 masters by about 1e-5: mostly below bfloat16's resolution
    masters_moved = sum(int((m != b.float()).sum()) for (_, m), b in zip(learner.masters.pairs, before))
    weights_moved = sum(int((w != b).sum()) for w, b in zip(weights, before))
    assert masters_moved > 2 * weights_moved

    tensors, state = learner.checkpoint()
    resumed = bfloat16_learner(tiny_policy)
    with torch.no_grad():
        for target, source in zip(resumed.policy.actor_parameters(), weights):
            target.copy_(source)
    resumed.restore(tensors, state)
    for (_, master), (_, twin) in zip(resumed.masters.pairs, learner.masters.pairs):
        assert torch.equal(master, twin)
    assert all("float32_master" not in learner.optimizer.state[p] for p in learner.parameters)
