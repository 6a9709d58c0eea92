"""The hf engine's batching: a request the sampler cannot serve fails alone, and a seeded request is sampled the
same, whoever it is batched with."""

import asyncio

import pytest
import torch

from unipg.inference import HFService, SamplingParams


@pytest.fixture(scope="module")
def policy(tiny_policy):
    return tiny_policy()


def batched(policy, requests):
    """Each ``(context, params)`` generated as one batch (the engine waits until every episode asks); the turns,
    or the errors in their place."""
    service = HFService(policy, SamplingParams(), generator=torch.Generator().manual_seed(0), batch_wait=None)

    async def one(context, params):
        async with service.episode():
            return await service.generate(context, max_new_tokens=4, params=params)

    async def all_of_them():
        async with service.running():
            return await asyncio.gather(*(one(*request) for request in requests), return_exceptions=True)

    return asyncio.run(all_of_them()), service


def test_a_request_whose_sampling_fails_fails_alone(policy):
    degenerate = SamplingParams()
    degenerate.temperature = 1e-300  # past the checks: logits / 1e-300 are inf and NaN, and sampling raises
    too_long = [5] * policy.context_length  # fills the model's context: no room for a completion
    fine = [4, 5, 6]
    outputs, service = batched(
        policy, [(fine, None), (fine, degenerate), (too_long, None), (fine, SamplingParams(temperature=0.0))]
    )
    first, hot, long, greedy = outputs
    assert isinstance(hot, RuntimeError) and "probability tensor" in str(hot)
    assert isinstance(long, ValueError) and "no room for a completion" in str(long)
    assert first.token_ids and greedy.token_ids and service.turns == 2  # answered, and only those counted


def test_sampling_parameters_the_config_refuses_are_refused_by_the_engine_too():
    for options, phrase in (
        ({"temperature": 1e-300}, "smallest positive temperature is 0.01"),
        ({"temperature": float("nan")}, "finite"),
        ({"stop": [""]}, "must not be empty"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_k": 0}, "top_k must be at least 1"),
    ):
        with pytest.raises(ValueError, match=phrase):
            SamplingParams(**options)
    assert SamplingParams(temperature=0.0).temperature == 0.0 and SamplingParams(temperature=0.01).temperature


def test_a_top_p_too_small_for_float32_keeps_the_likeliest_token(policy):
    """top_p 1e-300 is 0 in float32: the nucleus keeps its likeliest token all the same, as for any top_p > 0."""
    [nucleus, greedy], _ = batched(
        policy, [([4, 5, 6], SamplingParams(top_p=1e-300)), ([4, 5, 6], SamplingParams(temperature=0.0))]
    )
    assert nucleus.token_ids == greedy.token_ids


def test_a_seeded_request_samples_the_same_tokens_whatever_it_is_batched_with(policy):
    context, seeded = [4, 5, 6], SamplingParams(temperature=1.0, seed=11)
    [alone], _ = batched(policy, [(context, seeded)])
    crowded, service = batched(
        policy, [([7, 8], None), (context, seeded), ([9] * 5, None), (context, SamplingParams(temperature=1.0))]
    )
    assert crowded[1].token_ids == alone.token_ids and crowded[1].behaviour_logprobs == alone.behaviour_logprobs
    assert service.batches == [3, 1]  # the unseeded requests batched together, the seeded one alone
    [other], _ = batched(policy, [(context, SamplingParams(temperature=1.0, seed=12))])
    assert other.token_ids != alone.token_ids
