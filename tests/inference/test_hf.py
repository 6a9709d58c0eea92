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


def test_requests_that_keep_arriving_join_one_batch(policy):
    """While the episodes' requests keep arriving (each window of ``batch_wait`` brings one), the engine waits for
    more, so external agents, whose requests come one HTTP request at a time, are not split into many calls; the
    first window that brings none ends the wait, though an episode still has not asked."""
    service = HFService(policy, SamplingParams(temperature=0.0), batch_wait=0.01)
    late: list = []
    windows = []

    async def window(seconds):  # one window of batch_wait: the next late request arrives in it, if one is left
        windows.append(seconds)
        if late:
            late.pop(0).set()
            await asyncio.sleep(0)  # its episode queues its request
            await asyncio.sleep(0)
        return False

    service._all_waiting_within = window

    async def one(arrive: asyncio.Event | None):
        async with service.episode():
            if arrive is not None:
                await arrive.wait()
            return await service.generate([4, 5, 6], max_new_tokens=2)

    async def never_asks(done: asyncio.Event):
        async with service.episode():
            await done.wait()

    async def all_of_them():
        done = asyncio.Event()
        late.extend(asyncio.Event() for _ in range(3))
        async with service.running():
            idle = asyncio.ensure_future(never_asks(done))
            turns = await asyncio.gather(one(None), *(one(event) for event in list(late)))
            done.set()
            await idle
        return turns

    turns = asyncio.run(all_of_them())
    assert len(turns) == 4 and all(turn.token_ids for turn in turns)
    assert service.batches == [4]  # one call: the first request and the three that came one window after another
    assert len(windows) == 4  # three windows that brought a request, then one that brought none


def test_a_busy_endpoint_keeps_the_batch_waiting_though_no_request_arrived(policy):
    """An HTTP request of the endpoint beginning or ending (``note_activity``) counts as a request arriving: an
    external agent is between its calls, so the engine waits on for it."""
    service = HFService(policy, SamplingParams(temperature=0.0), batch_wait=0.01)
    busy_windows = 2
    arrive = asyncio.Event()
    windows = []

    async def window(seconds):  # the endpoint is busy in two windows, and the late request comes in the third
        windows.append(seconds)
        if len(windows) <= busy_windows:
            service.note_activity()
        elif not arrive.is_set():
            arrive.set()
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        return False

    service._all_waiting_within = window

    async def one(wait: bool):
        async with service.episode():
            if wait:
                await arrive.wait()
            return await service.generate([4, 5, 6], max_new_tokens=2)

    async def both():
        async with service.running():
            return await asyncio.gather(one(False), one(True))

    turns = asyncio.run(both())
    assert all(turn.token_ids for turn in turns) and service.batches == [2]
