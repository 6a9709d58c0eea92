"""The ``vllm`` engine as ``sample.engine`` names it (``vllm_engine``): one vLLM engine for the policy
(``unipg.inference.vllm``), or with a model per role (``agent.role_policy: separate``) one per role's model, all in
this process, and a service that sends each request to its role's engine.

vLLM holds one model per engine, so each role's model gets an engine of its own (``SharedVLLM`` keyed by the role).
The router's service is the one service surface of ``unipg.inference.vllm.VLLMService``: ``generate`` goes to the
service of the request's role (a request must name its role), ``running`` runs every role's service, and a weight
sync (``sync``, the concurrent schedule's) is pulled once for all roles, each role's engine then loading its role's
model of that version. The roles' engines step apart (one stepping thread each), so a batch never mixes roles.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AsyncExitStack, asynccontextmanager

import torch

from unipg.inference.base import ENGINES, SamplingParams, TurnOutput
from unipg.inference.vllm import SharedVLLM, VLLMService, WeightPull
from unipg.policy.role_policies import RolePolicies


class RoleVLLM:
    """A vLLM engine per role of a ``RolePolicies``, behind one engine surface (module docstring)."""

    name = "vllm"

    def __init__(self, policy: RolePolicies, config):
        self.policy = policy
        self.engines: dict[str, SharedVLLM] = {}
        try:
            for role in policy.roles:
                self.engines[role] = SharedVLLM(policy.for_role(role), config, role=role)
        except BaseException:
            self.close()
            raise

    @property
    def version(self) -> int:
        return min(engine.version for engine in self.engines.values())

    def service(
        self,
        params: SamplingParams,
        generator: torch.Generator | None,
        *,
        batch_wait: float | None = None,
        max_batch: int = 0,
        sync: Callable[[], int | None] | None = None,
    ) -> RoleVLLMService:
        services = {role: engine.service(params, generator) for role, engine in self.engines.items()}
        return RoleVLLMService(services, sync)

    def metrics(self) -> dict[str, float]:
        """The roles' engine counters, summed."""
        metrics: dict[str, float] = {}
        for engine in self.engines.values():
            for name, value in engine.metrics().items():
                metrics[name] = metrics.get(name, 0.0) + value
        return metrics

    def close(self) -> None:
        engines, self.engines = self.engines, {}
        for engine in engines.values():
            engine.close()


class RoleVLLMService:
    """The service surface on every role's ``VLLMService``: requests go to their role's."""

    def __init__(self, services: dict[str, VLLMService], sync: Callable[[], int | None] | None):
        self.services, self.sync = services, sync
        self._pull = WeightPull(sync, self.load_version)

    @property
    def policy_version(self) -> int:
        return min(service.policy_version for service in self.services.values())

    @policy_version.setter
    def policy_version(self, version: int) -> None:  # the driver sets it before running (sequential schedule)
        for service in self.services.values():
            service.policy_version = version

    @property
    def turns(self) -> int:
        return sum(service.turns for service in self.services.values())

    @property
    def prefill_tokens(self) -> int:
        return sum(service.prefill_tokens for service in self.services.values())

    def pop_batches(self) -> tuple[list[int], float]:
        """Every role's engine steps (role after role) and their seconds since the last call."""
        sizes, seconds = [], 0.0
        for service in self.services.values():
            role_sizes, role_seconds = service.pop_batches()
            sizes += role_sizes
            seconds += role_seconds
        return sizes, seconds

    @asynccontextmanager
    async def running(self):
        async with AsyncExitStack() as stack:
            for service in self.services.values():
                await stack.enter_async_context(service.running())
            yield self

    @asynccontextmanager
    async def episode(self):
        yield  # vLLM batches continuously: nothing waits for the set of running episodes

    async def generate(
        self,
        context_ids: list[int],
        *,
        max_new_tokens: int,
        order: int = 0,
        params: SamplingParams | None = None,
        role: str | None = None,
    ) -> TurnOutput:
        """One turn continuing ``context_ids``, sampled by ``role``'s model (``VLLMService.generate``)."""
        if role not in self.services:
            raise ValueError(
                f"with a model per role (agent.role_policy=separate) every request names its role; got {role!r}, "
                f"roles: {', '.join(self.services)}"
            )
        await self._pull()
        return await self.services[role].generate(
            context_ids, max_new_tokens=max_new_tokens, order=order, params=params
        )

    async def load_version(self, version: int) -> None:
        """The weights ``sync`` handed as ``version``, for all roles: each role's engine loads its role's model."""
        for service in self.services.values():
            await service.load_version(version)


@ENGINES.register("vllm")
def vllm_engine(policy, config):
    """vLLM in this process: continuous batching and prefix caching; log-probs of vLLM's own kernels. With a model
    per role (a ``RolePolicies``), an engine per role's model."""
    if isinstance(policy, RolePolicies):
        return RoleVLLM(policy, config)
    return SharedVLLM(policy, config)
