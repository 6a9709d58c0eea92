"""The vllm engine with a LoRA adapter per role (``agent.role_policy: adapters``), for real (vLLM on CPU with the
embedded model): a role's turns are sampled with its own adapter, by version, with the trainer's log-probs.

One engine serves the module (starting vLLM takes tens of seconds).
"""

import asyncio
from pathlib import Path

import pytest
import torch

from tests.inference.test_engines import child_processes, make_runner, prompts, trainer_logprobs
from unipg.config import load_config
from unipg.inference import SamplingParams
from unipg.policy.adapters import role_adapter
from unipg.policy.loading import load_lm_policy

pytest.importorskip("vllm")

ROLES = ["solver", "checker"]


@pytest.fixture(scope="module")
def policy(embedded_path):
    torch.manual_seed(0)
    policy = load_lm_policy(embedded_path, lora_rank=4, roles=ROLES)
    perturb(policy, "solver", 0.5)  # B is zero at initialisation: every adapter starts as the identity
    return policy


@pytest.fixture(scope="module")
def runner(policy):
    children_before = set(child_processes())
    runner = make_runner(policy, ["model.lora_rank=4"])
    runner.engine  # noqa: B018 — start vLLM once for the module
    yield runner
    runner.close()
    assert set(child_processes()) <= children_before


def perturb(policy, role: str, change: float) -> None:
    with torch.no_grad():
        for name, parameter in policy.model.named_parameters():
            if f".lora_B.{role}." in name:
                parameter.add_(change)


def generate_by_role(runner, context, roles, *, version, seed=1):
    """One turn per role of ``roles`` continuing ``context``, all in flight together, each with the same seed."""
    service = runner.inference_service(torch.Generator().manual_seed(0), params=SamplingParams(temperature=1.0))
    service.policy_version = version
    params = SamplingParams(temperature=1.0, seed=seed)

    async def go():
        async with service.running():
            return await asyncio.gather(
                *(service.generate(context, max_new_tokens=16, params=params, role=role) for role in roles)
            )

    return asyncio.run(go())


def check_roles(runner, policy, *, version):
    [context] = prompts(policy, 1)
    outputs = generate_by_role(runner, context, ROLES, version=version)
    for role, out in zip(ROLES, outputs):
        assert out.engine == "vllm" and out.policy_version == version and len(out.token_ids) > 0
        with role_adapter(policy.model, role):
            expected = trainer_logprobs(policy, context, out.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(out.behaviour_logprobs), expected, atol=1e-3, rtol=0)
    solver, checker = outputs
    assert solver.behaviour_logprobs != checker.behaviour_logprobs  # each role its own adapter
    with role_adapter(policy.model, "checker"):  # the solver's turn is not what the checker's adapter gives
        other = trainer_logprobs(policy, context, solver.token_ids, 1.0)
    assert not torch.allclose(torch.tensor(solver.behaviour_logprobs), other, atol=1e-3, rtol=0)
    return outputs


def test_each_roles_turns_are_sampled_with_its_adapter_by_version(runner, policy):
    engine = runner.engine.core
    before = check_roles(runner, policy, version=0)
    ids = {role: engine.current_adapter(role).lora_int_id for role in ROLES}
    folders = {Path(engine.current_adapter(role).lora_path) for role in ROLES}
    assert len(set(ids.values())) == 2 and all(folder.is_dir() for folder in folders)

    perturb(policy, "checker", -0.5)
    after = check_roles(runner, policy, version=1)
    assert engine.version == 1
    assert all(engine.current_adapter(role).lora_int_id not in ids.values() for role in ROLES)  # new ids
    assert not any(folder.exists() for folder in folders)  # the older version's adapters are gone
    assert after[0].token_ids == before[0].token_ids  # the solver's adapter and seed did not change
    assert after[0].behaviour_logprobs == pytest.approx(before[0].behaviour_logprobs, abs=1e-4)
    assert after[1].behaviour_logprobs != before[1].behaviour_logprobs  # the checker's did


def test_a_request_must_name_a_role_of_the_model(runner, policy):
    [context] = prompts(policy, 1)
    for role in (None, "judge"):
        with pytest.raises(ValueError, match=r"one adapter per role \(solver, checker\)"):
            generate_by_role(runner, context, [role], version=1)


def test_a_run_may_sample_role_adapters_with_vllm():
    settings = ["task.name=solver_checker", "algorithm=grpo", "model.lora_rank=4", "agent.role_policy=adapters"]
    config = load_config(overrides=[*settings, "sample.engine=vllm"])
    assert (config.sample.engine, config.agent.role_policy) == ("vllm", "adapters")
