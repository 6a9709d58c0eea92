"""What every inference engine shares: the request and the answer of one turn, and the registry of engines.

An engine (``ENGINES.get(name)(policy, config)``, chosen by ``sample.engine``) owns a generator of the policy's
tokens for a whole run: the batching sampler of ``LMPolicy`` (``hf``) or vLLM (``vllm``). For each batch of
episodes it hands out a *service* (``engine.service(params, generator, ...)``), the surface the agent loop talks
to::

    async with service.running():             # the engine serves while inside
        async with service.episode():         # count an episode as running
            out = await service.generate(context_ids, max_new_tokens=64)   # -> TurnOutput

plus ``policy_version`` (the weights version stamped on each turn; the driver sets it) and ``pop_batches()``
(sizes of the generation batches and their seconds, for the batching metrics). New weights reach the engine
by version: a service built with ``sync`` calls it between generate requests (``WeightSync.pull`` or a rollout
worker's loader, which load the learner's weights into ``policy``) and, when it returns a version, the engine
takes ``policy``'s weights; a service built without ``sync`` takes them when its ``policy_version`` differs from
the engine's when it starts running.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from unipg.config.sampling import SAMPLING_CHECKS
from unipg.registry import Registry


@dataclass
class TurnOutput:
    """One sampled turn of one episode."""

    token_ids: list[int]  # sampled tokens, EOS included when the turn stopped on it
    behaviour_logprobs: list[float]  # log μ of each sampled token, as the engine computed it
    text: str  # decoded turn, special tokens removed, cut before a stop string (after one of `keep_stop`)
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    ended_with_eos: bool
    policy_version: int  # the weights version that sampled this turn (its first token, when it changed)
    engine: str = "hf"  # the engine that sampled it: "hf" computes log μ with the trainer's own code, others not
    # (token offset in the turn, version): a weight load interrupted the turn and this newer version sampled its
    # tokens from that offset on (``runtime.partial_rollouts``, vllm engine); empty: one version sampled it all
    version_changes: tuple[tuple[int, int], ...] = ()


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] | None = None
    keep_stop: tuple[str, ...] = ()  # stop strings that belong to the turn's text (a call's closing tag)
    seed: int | None = None  # the request's own: its tokens drawn from a generator of this seed, whatever the batch
    # the JSON schema (its text) the turn must match: tokens drawn only where the schema's grammar allows them
    # (unipg.inference.structured), so its behaviour log-probs are those of the masked distribution
    json_schema: str | None = None

    def __post_init__(self):
        # the values the config and the endpoint refuse never reach a sampler (unipg.config.sampling)
        for name, check in SAMPLING_CHECKS.items():
            check(getattr(self, name))


class Engine(Protocol):
    """A run's generator of policy tokens (module docstring)."""

    name: str

    def service(
        self,
        params: SamplingParams,
        generator: torch.Generator | None,
        *,
        batch_wait: float | None,
        max_batch: int,
        sync=None,
    ): ...

    def metrics(self) -> dict[str, float]:
        """Counters since the last call, e.g. ``engine/weight_sync_seconds`` (names under ``engine/``)."""

    def close(self) -> None:
        """Free the engine; no thread or process of it is left afterwards."""


ENGINES: Registry = Registry("inference engine")
"""name → factory(policy, config) -> Engine; ``sample.engine`` picks one."""
