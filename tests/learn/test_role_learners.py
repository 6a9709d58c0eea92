"""``agent.role_policy: separate``: a learner per role's model, each trained on its own role's rows alone."""

import pytest
import torch

from tests.helpers.batches import skewed_batch, skewed_config
from unipg.learn.role_learners import RoleLearners
from unipg.policy.role_policies import RolePolicies

ROLES = ["solver", "checker"]
ROW_ROLES = ["solver", "checker", "solver", "checker", "solver", "checker"]  # skewed_batch's six rows
CHECKER_ROWS = [1, 3, 5]


@pytest.fixture
def learner(tiny_policy) -> RoleLearners:
    """Two fresh models (seeded alike, so two learners built in one test start equal), one group of 3 rows per role."""
    settings = skewed_config("agent.role_policy=separate", "sample.samples_per_prompt=3", "train.weight_decay=0.1")
    return RoleLearners(RolePolicies({role: tiny_policy() for role in ROLES}), settings)


def snapshot(learner: RoleLearners, role: str) -> tuple[list[torch.Tensor], list[dict]]:
    """The role's model weights and the optimizer's state (moments, step) of each of them."""
    own = learner.learners[role]
    weights = [p.detach().clone() for p in own.policy.model.parameters()]
    state = [{k: v.clone() for k, v in own.optimizer.state[p].items()} for p in own.parameters]
    return weights, state


def same(first, second) -> bool:
    weights = all(torch.equal(a, b) for a, b in zip(first[0], second[0]))
    states = all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(first[1], second[1]))
    return weights and states


def learn(learner: RoleLearners, batch) -> dict[str, float]:
    """``prepare`` and ``update`` on ``batch``; the metrics of both."""
    prepared = learner.prepare(batch, ROW_ROLES)
    return {**prepared, **learner.update(batch, ROW_ROLES)}


def test_a_role_whose_rows_have_no_loss_keeps_its_model_and_optimizer_state(learner):
    metrics = learn(learner, skewed_batch())  # both roles trained: each has Adam moments now
    assert metrics["role/solver/grad_norm"] > 0 and metrics["role/checker/grad_norm"] > 0
    before = {role: snapshot(learner, role) for role in ROLES}
    assert all(before[role][1][0] for role in ROLES)

    batch = skewed_batch(1)
    batch.completion_mask[CHECKER_ROWS] = 0  # the checker's rows have no loss token: only the solver's count
    metrics = learn(learner, batch)
    assert same(snapshot(learner, "checker"), before["checker"])  # weights, moments and step count as they were
    assert not same(snapshot(learner, "solver"), before["solver"])
    assert "role/solver/loss" in metrics and "role/checker/loss" not in metrics
    assert metrics["loss"] == metrics["role/solver/loss"]  # the unprefixed metrics: the stepped roles' mean


def test_a_roles_model_moves_with_its_own_rows_only(tiny_policy, learner):
    settings = learner.config
    other = RoleLearners(RolePolicies({role: tiny_policy() for role in ROLES}), settings)
    batch, changed = skewed_batch(), skewed_batch()
    generator = torch.Generator().manual_seed(7)
    completion = changed.input_ids[:, -changed.completion_length :]
    completion[CHECKER_ROWS] = torch.randint(8, 90, completion[CHECKER_ROWS].shape, generator=generator)
    changed.scores[CHECKER_ROWS] = torch.tensor([5.0, -3.0, 1.0])  # the checker's rows: other tokens, other rewards
    first, second = learn(learner, batch), learn(other, changed)
    assert same(snapshot(learner, "solver"), snapshot(other, "solver"))  # the checker's rows never reach the solver
    assert not same(snapshot(learner, "checker"), snapshot(other, "checker"))
    assert first["role/solver/loss"] == second["role/solver/loss"]
    assert first["role/checker/reward_mean"] != second["role/checker/reward_mean"]


def test_checkpoint_and_restore_every_roles_optimizer(tiny_policy, learner):
    learn(learner, skewed_batch())
    tensors, state = learner.checkpoint()
    assert set(state["roles"]) == set(ROLES)
    assert {name.split(".")[0] for name in tensors} == set(ROLES)
    other = RoleLearners(RolePolicies({role: tiny_policy() for role in ROLES}), learner.config)
    other.restore(tensors, state)
    for role in ROLES:
        assert other.learners[role].optimizer.state_dict()["state"].keys() == (
            learner.learners[role].optimizer.state_dict()["state"].keys()
        )
    with pytest.raises(ValueError, match="agent.role_policy setting changed"):
        other.restore(tensors, {"roles": {"solver": state["roles"]["solver"]}})


def test_rows_must_name_a_role_with_a_model(learner):
    with pytest.raises(ValueError, match="role of every row"):
        learner.prepare(skewed_batch())
    with pytest.raises(ValueError, match=r"role\(s\) critic, which have no model"):
        learner.prepare(skewed_batch(), ["critic"] * 6)
