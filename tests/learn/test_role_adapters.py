"""``agent.role_policy: adapters``: each role's rows train that role's LoRA adapter, and nothing of another role's."""

import asyncio

import pytest
import torch

from tests.helpers.batches import skewed_batch, skewed_config
from unipg.inference import HFService
from unipg.inference.base import SamplingParams
from unipg.learn.lm import LMLearner
from unipg.policy.adapters import role_adapter, role_adapter_parameters

pytest.importorskip("peft")

ROLES = ["solver", "checker"]
ROW_ROLES = ["solver", "solver", "solver", "checker", "checker", "checker"]  # skewed_batch's six rows


def adapters_learner(tiny_policy, *overrides: str) -> LMLearner:
    policy = tiny_policy(lora_rank=4, roles=ROLES)
    settings = skewed_config("model.lora_rank=4", "agent.role_policy=adapters", "train.weight_decay=0.1", *overrides)
    return LMLearner(policy, settings)


def snapshot(learner: LMLearner, role: str) -> tuple[list[torch.Tensor], list[dict]]:
    """The role's adapter weights and, for each of them, the optimizer's state (moments, step)."""
    group = next(group for group in learner.optimizer.param_groups if group.get("role") == role)
    weights = [p.detach().clone() for p in role_adapter_parameters(learner.policy.model, role)]
    state = [{k: v.clone() for k, v in learner.optimizer.state[p].items()} for p in group["params"]]
    return weights, state


def same(first, second) -> bool:
    weights = all(torch.equal(a, b) for a, b in zip(first[0], second[0]))
    states = all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(first[1], second[1]))
    return weights and states


def test_a_role_whose_rows_have_no_loss_keeps_its_adapter_and_optimizer_state(tiny_policy):
    learner = adapters_learner(tiny_policy, "train.micro_batch_size=2")
    learner.update(skewed_batch(), ROW_ROLES)  # both roles trained: each has Adam moments now
    before = {role: snapshot(learner, role) for role in ROLES}
    assert all(before[role][1][0] for role in ROLES)

    batch = skewed_batch(1)
    batch.completion_mask[3:] = 0  # the checker's rows have no loss token: only the solver's tokens count
    learner.optimizer.zero_grad(set_to_none=True)
    learner.accumulate_gradients(batch, torch.arange(3))  # the solver's loss reaches the solver's adapter alone
    assert all(p.grad is None for p in role_adapter_parameters(learner.policy.model, "checker"))
    assert all(p.grad is not None for p in role_adapter_parameters(learner.policy.model, "solver"))

    metrics = learner.update(batch, ROW_ROLES)
    assert same(snapshot(learner, "checker"), before["checker"])  # weights, moments and step count as they were
    assert not same(snapshot(learner, "solver"), before["solver"])
    assert metrics["role/solver/grad_norm"] > 0 and metrics["role/checker/grad_norm"] == 0


def test_micro_batches_never_mix_roles_and_run_under_their_roles_adapter(tiny_policy):
    learner = adapters_learner(tiny_policy, "train.micro_batch_size=3")
    learner.roles.assign(["checker", "solver"] * 3)
    groups = learner.micro_batches(skewed_batch(), torch.arange(6))
    assert sorted(torch.cat(groups).tolist()) == list(range(6))
    assert all(len({learner.roles.rows[int(row)] for row in group}) == 1 for group in groups)
    model = learner.policy.model
    with role_adapter(model, "checker"):
        assert model.active_adapter == "checker"
        assert all(p.requires_grad for role in ROLES for p in role_adapter_parameters(model, role))


def test_rows_of_a_role_without_an_adapter_are_refused(tiny_policy):
    learner = adapters_learner(tiny_policy)
    with pytest.raises(ValueError, match="judge"):
        learner.update(skewed_batch(), ["judge"] * 6)


def test_the_hf_engine_samples_each_role_with_its_own_adapter(tiny_policy):
    policy = tiny_policy(lora_rank=4, roles=ROLES)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the checker's adapter moves the model away from the solver's (LoRA's B starts at 0)
        for parameter in role_adapter_parameters(policy.model, "checker"):
            parameter.add_(torch.randn(parameter.shape, generator=generator))
    service = HFService(policy, SamplingParams(temperature=0.0), batch_wait=None)
    context = policy.tokenizer("What is 12*34?", add_special_tokens=False)["input_ids"]

    async def both() -> list:
        async def turn(role: str, order: int):
            async with service.episode():
                return await service.generate(context, max_new_tokens=6, order=order, role=role)

        async with service.running():
            return await asyncio.gather(turn("solver", 0), turn("checker", 1))

    turns = asyncio.run(both())
    assert service.batches == [1, 1]  # one call per role
    for role, out in zip(ROLES, turns):
        with role_adapter(policy.model, role):
            alone = policy.sample([context], max_new_tokens=6, temperature=0.0)
        assert out.token_ids == alone.completion_ids[0, : len(out.token_ids)].tolist(), role
    assert turns[0].behaviour_logprobs != turns[1].behaviour_logprobs
