"""An endpoint on the embedded model, served from an event loop on a background thread."""

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

from unipg.config.lm import EndpointConfig
from unipg.sample.endpoint_agents import ExternalAgentLoop
from unipg.inference import HFService, SamplingParams


class RecordingEngine(HFService):
    """The inference engine, keeping every turn it sampled (to compare with what the learner gets)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sampled = []

    async def generate(self, context_ids, **options):
        output = await super().generate(context_ids, **options)
        self.sampled.append((list(context_ids), output))
        return output


@pytest.fixture(scope="module")
def policy(tiny_policy):
    return tiny_policy()


def make_loop(policy, **endpoint):
    engine = RecordingEngine(policy, SamplingParams(), generator=torch.Generator().manual_seed(0), batch_wait=0.005)
    return ExternalAgentLoop(engine, policy.tokenizer, eos_ids=policy.eos_ids, endpoint=EndpointConfig(**endpoint),
                             max_tokens=12, context_length=policy.context_length, describe_tools=True)


@pytest.fixture(scope="module")
def served(policy):
    """A running endpoint: ``loop`` (ExternalAgentLoop), ``call(coroutine)`` runs on its event loop."""
    loop = make_loop(policy, max_body_bytes=4096, max_n=4)
    event_loop = asyncio.new_event_loop()
    ready, stop = threading.Event(), None

    async def serve():
        nonlocal stop
        stop = asyncio.Event()
        async with loop.running():
            ready.set()
            await stop.wait()

    thread = threading.Thread(target=event_loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(60)

    def call(coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, event_loop).result(60)

    yield SimpleNamespace(loop=loop, call=call)
    event_loop.call_soon_threadsafe(stop.set)
    thread.join(30)
