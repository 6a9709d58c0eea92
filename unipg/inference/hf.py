"""The ``hf`` engine: one policy, many concurrent episodes, batched generation (dynamic batching).

Agents that wait on tools must not turn into batch-size-1 generate calls. Each episode ``await``s
``engine.generate(context_ids)``; the engine collects pending requests and runs them as one batched
``LMPolicy.sample`` call as soon as every running episode is waiting for generation. While other episodes are
still busy (with tools, or an external agent with its own code and HTTP), it waits for their requests as long as
they keep arriving: until none has come for ``batch_wait`` seconds, and at most as long as the last generate call
took (waiting longer would cost more than a second call does). An HTTP request of the endpoint beginning or ending
counts as an arrival (``note_activity``): external agents' requests, which come one after another, each after the
agent's own code, so join one batch instead of splitting it into several calls. Generation runs on
a worker thread (torch releases the GIL), so tool calls proceed while the model samples.

With ``batch_wait=None`` the engine only generates when every running episode is waiting: batches are then
a function of the episodes alone, not of tool timing, which makes seeded runs reproducible.

With ``sync`` (asynchronous training: ``WeightSync.pull``), the engine loads newer weights between generate
calls, so an episode's turns may come from different versions; each turn records the version that sampled it.

A request the sampler cannot serve (its context, its parameters) fails alone: a batched call that raises is
retried in halves down to the requests that fail, and only those get the error.

A request with a ``seed`` of its own (``SamplingParams.seed``) is sampled alone, from a generator of that seed:
the batched sampler draws every row from one generator, so a row's draws would depend on the rows beside it.
Its turn is then the same whatever else is pending, at the cost of a generate call of its own.

A request whose reply must match a JSON schema (``SamplingParams.json_schema``) is batched with the others of its
parameters: its grammar masks the logits of its own row alone (``unipg.inference.structured.RowGrammars``).

With one LoRA adapter per role (``agent.role_policy: adapters``) a request names its ``role``, and the requests
of a batch are sampled role by role, each with its role's adapter active, as they are by sampling parameters; with a
model per role (``agent.role_policy: separate``, the policy a ``RolePolicies``) each role's with its role's model.

The sampler is the trainer's own model code (``LMPolicy.sample``), so its behaviour log-probs are the trainer's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import replace

import torch

from unipg.inference.base import ENGINES, SamplingParams, TurnOutput
from unipg.inference.structured import RowGrammars
from unipg.policy.adapters import role_adapter
from unipg.policy.generation import cut_at_stop
from unipg.policy.lm import LMPolicy
from unipg.policy.role_policies import RolePolicies, policy_for_role

FIRST_CALL_WAIT = 0.25  # seconds a first generate call waits for the other episodes' requests at most


class HFService:
    """Batches ``generate`` requests of concurrent episodes into ``LMPolicy.sample`` calls."""

    def __init__(
        self,
        policy: LMPolicy,
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
        batch_wait: float | None = 0.005,
        max_batch: int = 512,
        sync: Callable[[], int | None] | None = None,
    ):
        self.policy, self.params, self.generator, self.sync = policy, params, generator, sync
        self.batch_wait, self.max_batch = batch_wait, max_batch
        self.policy_version = 0  # bumped by the driver whenever the weights change
        self.batches: list[int] = []  # size of every generate call, for the batching metrics
        self.generate_seconds = 0.0  # wall time inside generate calls
        self.last_call_seconds = 0.0  # wall time of the latest generate call
        self.activity = 0  # requests of the OpenAI-compatible endpoint begun or ended (``note_activity``)
        self.turns = 0  # generate requests answered
        self.prefill_tokens = 0  # context tokens the model ran before sampling (all of each context: no reuse)
        # (order, context, budget, future, params or None, role or None)
        self._pending: list[tuple[int, list[int], int, asyncio.Future, SamplingParams | None, str | None]] = []
        self._active = 0
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None

    def pop_batches(self) -> tuple[list[int], float]:
        """Sizes of the generate calls and their seconds since the last call."""
        sizes, seconds = self.batches, self.generate_seconds
        self.batches, self.generate_seconds = [], 0.0
        return sizes, seconds

    @asynccontextmanager
    async def running(self):
        """Run the batching worker for the duration of the block."""
        self._wakeup = asyncio.Event()
        self._worker = asyncio.create_task(self._serve())
        try:
            yield self
        finally:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
            self._worker = None

    @asynccontextmanager
    async def episode(self):
        """Count an episode as running while inside the block (the engine waits for running episodes)."""
        self._active += 1
        try:
            yield
        finally:
            self._active -= 1
            self._wakeup.set()

    async def generate(
        self,
        context_ids: list[int],
        *,
        max_new_tokens: int,
        order: int = 0,
        params: SamplingParams | None = None,
        role: str | None = None,
    ) -> TurnOutput:
        """Sample one turn continuing ``context_ids``; ``order`` fixes the row order inside a batch; ``params``
        (optional) replaces the engine's sampling parameters for this request; ``role``: sample with that role's
        adapter (``agent.role_policy: adapters``; None: the model as it is)."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((order, context_ids, max_new_tokens, future, params, role))
        self._wakeup.set()
        return await future

    async def _serve(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            self._pending = [request for request in self._pending if not request[3].done()]  # episodes cancelled
            if not self._pending:
                continue
            if len(self._pending) < min(self._active, self.max_batch):
                if self.batch_wait is None:
                    continue  # wait until every running episode asks
                await self._gather()
            batch = sorted(self._pending, key=lambda request: request[0])[: self.max_batch]
            taken = {id(request) for request in batch}
            self._pending = [request for request in self._pending if id(request) not in taken]
            try:
                outputs = await asyncio.to_thread(self._sample_by_params, batch)
            except Exception as error:  # noqa: BLE001 — hand the failure to the waiting episodes
                outputs = [error] * len(batch)
            for request, output in zip(batch, outputs):
                if request[3].done():  # its episode may have been cancelled meanwhile
                    continue
                if isinstance(output, Exception):
                    request[3].set_exception(output)
                else:
                    request[3].set_result(output)
            if self._pending:
                self._wakeup.set()

    async def _gather(self) -> None:
        """Wait for more requests while they keep arriving: until every running episode waits, or no request
        came for ``batch_wait`` seconds, or as long as the last generate call took has passed since the first
        (waiting longer would cost more than a second call does; before the first call, ``FIRST_CALL_WAIT``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(self.batch_wait, self.last_call_seconds or FIRST_CALL_WAIT)
        while True:
            arrived = (len(self._pending), self.activity)
            if await self._all_waiting_within(min(self.batch_wait, max(deadline - loop.time(), 0))):
                return
            if (len(self._pending), self.activity) == arrived or loop.time() >= deadline:
                return

    def note_activity(self) -> None:
        """An HTTP request of the endpoint began or ended: an external agent is busy, and its next request is on
        its way, so a wait for more requests goes on as it does when a request arrives."""
        self.activity += 1

    async def _all_waiting_within(self, seconds: float) -> bool:
        """Whether every running episode asked within ``seconds``."""
        try:
            await asyncio.wait_for(self._all_waiting(), seconds)
        except (asyncio.TimeoutError, TimeoutError):
            return False
        return True

    async def _all_waiting(self) -> None:
        while len(self._pending) < min(self._active, self.max_batch):
            self._wakeup.clear()
            await self._wakeup.wait()

    def _sample_by_params(self, batch: list[tuple]) -> list[TurnOutput | Exception]:
        """One sampling call per distinct set of parameters and role in ``batch`` (one call when no request
        overrides and none names a role), and one per request with a seed of its own; a request whose sampling fails gets its error in place of its turn,
        and the others their turns."""
        if self.sync is not None:  # between generate calls: take the learner's newest weights (once per batch)
            version = self.sync()
            if version is not None:
                self.policy_version = version
        outputs: list[TurnOutput | Exception | None] = [None] * len(batch)
        chosen = [request[4] or self.params for request in batch]
        # a grammar masks its own row alone: requests that differ only in their schema share a call
        shared = [params if params.json_schema is None else replace(params, json_schema=None) for params in chosen]
        keys = [(params, request[5]) for params, request in zip(shared, batch)]
        kinds: list[tuple[SamplingParams, str | None]] = []
        for key in keys:
            if key not in kinds:
                kinds.append(key)
        for params, role in kinds:
            rows = [row for row, own in enumerate(keys) if own == (params, role)]
            for group in [rows] if params.seed is None else [[row] for row in rows]:  # a seeded request alone
                requests = [(batch[row][1], batch[row][2], chosen[row].json_schema) for row in group]
                for row, output in zip(group, self._sample_apart(requests, params, role)):
                    outputs[row] = output
        return outputs

    def _sample_apart(
        self, requests: list[tuple], params: SamplingParams, role: str | None = None
    ) -> list[TurnOutput | Exception]:
        """``_sample`` of (context, budget, JSON schema or None) requests, and where that fails, each half of them
        apart (down to single requests): a request the sampler cannot serve fails alone, whoever it is batched
        with, and a failure of the engine itself reaches every request (after about two calls per request)."""
        contexts, budgets, schemas = (list(column) for column in zip(*requests))
        try:
            return self._sample(contexts, budgets, schemas, params, role)
        except Exception as error:  # noqa: BLE001 — handed to the request it belongs to
            if len(requests) == 1:
                return [error]
        half = len(requests) // 2
        return self._sample_apart(requests[:half], params, role) + self._sample_apart(requests[half:], params, role)

    def _sample(
        self,
        contexts: list[list[int]],
        budgets: list[int],
        schemas: list[str | None] | None = None,
        params: SamplingParams | None = None,
        role: str | None = None,
    ) -> list[TurnOutput]:
        start = time.perf_counter()
        params = params or self.params
        generator = self.generator if params.seed is None else torch.Generator().manual_seed(params.seed)
        policy = policy_for_role(self.policy, role)  # with a model per role, the role's; else the one policy
        with role_adapter(policy.model, None if isinstance(self.policy, RolePolicies) else role):
            generation = policy.sample(
                contexts,
                max_new_tokens=max(budgets),
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                stop=params.stop,
                keep_stop=params.keep_stop,
                generator=generator,
                constraint=self._grammars(schemas or [], policy),
            )
        self.batches.append(len(contexts))
        self.turns += len(contexts)
        self.prefill_tokens += sum(len(context) for context in contexts)
        eos = set(self.policy.eos_ids)
        outputs = []
        for row, budget in enumerate(budgets):
            length = int(generation.completion_mask[row].sum())
            ids = generation.completion_ids[row, :length].tolist()
            finish, text = generation.finish_reasons[row], generation.texts[row]
            if length > budget:  # a shorter budget than the batch's: cut this row at its own budget
                ids, finish = ids[:budget], "length"
                text = cut_at_stop(self.policy.decode(ids), params.stop, params.keep_stop)
            outputs.append(
                TurnOutput(
                    ids,
                    generation.behaviour_logprobs[row, : len(ids)].tolist(),
                    text,
                    finish,
                    bool(ids) and ids[-1] in eos,
                    self.policy_version,
                )
            )
        self.last_call_seconds = time.perf_counter() - start
        self.generate_seconds += self.last_call_seconds
        return outputs

    def _grammars(self, schemas: list[str | None], policy: LMPolicy) -> RowGrammars | None:
        """The grammars of a call's rows that must match a JSON schema (None when no row must), for ``policy``'s
        vocabulary."""
        if not any(schemas):
            return None
        vocab_size = policy.model.get_output_embeddings().weight.shape[0]
        return RowGrammars(self.policy.tokenizer, vocab_size, self.policy.eos_ids, schemas)


class HFEngine:
    """The ``hf`` engine: services are ``HFService``s on the policy itself (its weights are the learner's or
    a copy that ``sync`` refreshes), so loading new weights is the caller's ``load_state_dict``."""

    name = "hf"

    def __init__(self, policy: LMPolicy):
        self.policy = policy

    def service(
        self,
        params: SamplingParams,
        generator: torch.Generator | None,
        *,
        batch_wait: float | None,
        max_batch: int,
        sync: Callable[[], int | None] | None = None,
    ) -> HFService:
        return HFService(
            self.policy, params, generator=generator, batch_wait=batch_wait, max_batch=max_batch, sync=sync
        )

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


@ENGINES.register("hf")
def hf_engine(policy: LMPolicy, config) -> HFEngine:
    """The policy's own batching sampler (LMPolicy.sample): log-probs computed by the trainer's code."""
    return HFEngine(policy)
