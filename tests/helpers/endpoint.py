"""An external-agent loop on a policy whose engine records every turn it sampled."""

import torch

from unipg.config.lm import EndpointConfig
from unipg.inference import HFService, SamplingParams
from unipg.sample.endpoint_agents import ExternalAgentLoop


class RecordingEngine(HFService):
    """The inference engine, keeping every turn it sampled (to compare with what the learner gets)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sampled = []

    async def generate(self, context_ids, **options):
        output = await super().generate(context_ids, **options)
        self.sampled.append((list(context_ids), output))
        return output


def make_loop(policy, **endpoint) -> ExternalAgentLoop:
    """An ``ExternalAgentLoop`` on ``policy`` (a ``RecordingEngine``, seed 0) with ``EndpointConfig(**endpoint)``."""
    engine = RecordingEngine(policy, SamplingParams(), generator=torch.Generator().manual_seed(0), batch_wait=0.005)
    return ExternalAgentLoop(
        engine,
        policy.tokenizer,
        eos_ids=policy.eos_ids,
        endpoint=EndpointConfig(**endpoint),
        max_tokens=12,
        context_length=policy.context_length,
        describe_tools=True,
    )
