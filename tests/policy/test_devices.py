"""Where the policy's parts live and in what precision: ``device`` and ``model.dtype`` reach the policy, its
critic and its reference; generation draws on the model's device from the run's one CPU generator."""

import torch

from unipg.config import load_config
from unipg.policy.generation import on_device
from unipg.policy.loading import load_lm_policy, policy_from_config


def test_dtype_applies_to_the_policy_critic_and_reference(embedded_path):
    policy = load_lm_policy(
        embedded_path, dtype="bfloat16", critic=embedded_path, reference="copy", needs_reference=True, device="cpu"
    )
    assert {p.dtype for p in policy.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in policy.critic.backbone.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in policy._reference.parameters()} == {torch.bfloat16}
    assert policy.critic.head.linear.weight.dtype == torch.float32  # value heads stay float32
    assert policy.device == torch.device("cpu")
    ids = [[3, 4, 5], [3, 4, 6]]
    generation = policy.sample(ids, max_new_tokens=3, generator=torch.Generator().manual_seed(0))
    assert generation.behaviour_logprobs.dtype == torch.float32  # log-probs are computed in float32


def test_a_text_runs_policy_goes_to_the_resolved_device(embedded_path):
    config = load_config(None, ["task.name=arithmetic", "algorithm=ppo", f"model.name={embedded_path}", "device=auto"])
    policy = policy_from_config(config)
    expected = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert policy.device.type == expected.type and policy.value_head.linear.weight.device.type == expected.type


def test_a_cpu_generator_draws_as_itself_on_the_cpu():
    generator = torch.Generator().manual_seed(3)
    assert on_device(generator, torch.device("cpu")) is generator and on_device(None, torch.device("cpu")) is None
