"""The ``vllm`` engine: vLLM in this process, behind the same service surface as the ``hf`` engine.

- Requests: each ``generate`` is its own vLLM request, added as soon as it is made and batched continuously
  with the others (``vllm_core.StepLoop``), so an episode waiting on a tool never holds the others back, and
  prefix caching reuses the KV cache of an episode's earlier turns.
- Log-probs: ``logprobs_mode="processed_logprobs"``, the log-probs of the distribution tokens are drawn from:
  softmax(logits / temperature) as the trainer computes them (greedy: softmax(logits)). With top-k or top-p,
  vLLM's are those of the truncated distribution, the trainer's of the full one; the objective's mismatch
  correction sees the difference (``TurnOutput.engine`` names the engine).
- Weights: vLLM loads the model from a folder this engine writes (``save_base_model``). A new version is
  loaded in place (``reload_weights``) once the requests in flight have finished; with LoRA only the adapter
  moves: it is saved in PEFT format and requests then carry a ``LoRARequest`` with a new id per version; with one
  adapter per role (``agent.role_policy: adapters``) a request of a role carries its role's (``vllm_adapters``). With
  ``runtime.partial_rollouts`` a load does not wait: the turns in flight are interrupted, and continue under the
  new weights from the tokens they had (``vllm_core``); each turn says which of its tokens which version sampled
  (``TurnOutput.version_changes``).
- No process: the engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); ``close`` stops the
  stepping thread, shuts the engine down and deletes its folder.
- Waits: a turn, a weight load, a sleep or a wake waits on the stepping thread while that thread makes progress;
  ``sample.engine_timeout`` seconds without any fail the wait with ``WaitTimeout`` (``vllm_core.StepLoop.wait``).
  Starting the engine waits on no other thread or process: it runs on the caller's.
- Settings: vLLM's import, its engine arguments and each request's sampling parameters are in ``vllm_setup``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import torch

from unipg.config.timeouts import WaitTimeout
from unipg.inference.base import SamplingParams, TurnOutput
from unipg.inference.vllm_adapters import AdapterVersions
from unipg.inference.vllm_core import StepLoop, turn_versions
from unipg.inference.vllm_setup import engine_args, import_vllm, vllm_sampling
from unipg.policy.adapters import base_state_dict, has_adapter, role_adapter_names, save_base_model
from unipg.policy.generation import cut_at_stop
from unipg.policy.lm import LMPolicy


class _ComputedBuffersFilter(logging.Filter):
    """Drops vLLM's warning, at every in-place weight reload, that rotary embeddings received no weights: their
    cos/sin cache is computed from the config, not trained, and stays as it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_ComputedBuffersFilter())


class VLLMEngine:
    """vLLM on ``policy``'s model, for a whole run (module docstring)."""

    name = "vllm"

    def __init__(self, policy: LMPolicy, config):
        start = time.perf_counter()
        import_vllm()
        from vllm.v1.engine.llm_engine import LLMEngine

        self.policy, self.sample = policy, config.sample
        self.lora = has_adapter(policy.model)
        self.partial = config.runtime.partial_rollouts  # a weight load interrupts the turns in flight
        self.version = 0  # the weights version vLLM holds
        self._folder = Path(tempfile.mkdtemp(prefix="unipg-vllm-"))
        self._sleeping, self._serving = False, 0  # asleep; services running on the engine
        self._counters = {"engine/weight_sync_seconds": 0.0, "engine/weight_syncs": 0.0}
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        random_states = random.getstate(), np.random.get_state(), torch.get_rng_state()
        try:
            save_base_model(policy.model, policy.tokenizer, self._folder / "model")
            args = engine_args(
                self._folder / "model",
                policy,
                self.sample,
                dtype=config.model.dtype,
                seed=config.seed,
                lora_rank=config.model.lora_rank if self.lora else 0,
                adapters=len(role_adapter_names(policy.model)),
            )
            self.llm = LLMEngine.from_engine_args(args)
        except BaseException:
            shutil.rmtree(self._folder, ignore_errors=True)
            raise
        finally:
            # vLLM's CPU worker lowers the thread count for serving and then turns torch.set_num_threads into a
            # no-op for the whole process; the learner shares this process and keeps its own.
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)
            # vLLM seeds the global generators with its seed; the run's own draws go on as if it had not
            random.setstate(random_states[0])
            np.random.set_state(random_states[1])
            torch.set_rng_state(random_states[2])
        self.adapters = AdapterVersions.of(self.llm, self._folder, policy.model)  # unused without LoRA
        if self.lora:
            self._use_adapter(0, self.adapters.save(policy.model))
        self.loop = StepLoop(self.llm, timeout=self.sample.engine_timeout)
        self.load_seconds = time.perf_counter() - start  # start-up: model saved, loaded and warmed up

    async def load(self, version: int, model) -> None:
        """Load ``model``'s current weights (its adapter, with LoRA) as ``version``, between requests."""
        start = time.perf_counter()
        if self.lora:
            folder = await asyncio.to_thread(self.adapters.save, model)
            job = lambda: self._use_adapter(version, folder)  # noqa: E731
        else:
            with torch.no_grad():
                state = {name: tensor.detach().clone() for name, tensor in base_state_dict(model).items()}
            job = lambda: self._reload(version, state)  # noqa: E731
        call = self.loop.call(job, interrupt=self.partial, tag=self.version)
        await self.loop.wait(call, f"loading the weights of version {version}")
        self._counters["engine/weight_sync_seconds"] += time.perf_counter() - start
        self._counters["engine/weight_syncs"] += 1

    def _reload(self, version: int, state: dict[str, torch.Tensor]) -> None:
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": list(state.items()), "is_checkpoint_format": True}
        )
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        self.version = version

    def _use_adapter(self, version: int, folder: Path) -> None:
        self.adapters.use(version, folder)
        self.version = version

    def current_adapter(self, role: str | None = None):
        """The ``LoRARequest`` a request of ``role`` carries now (None: the model's one adapter)."""
        return self.adapters.request(role)

    async def wake(self) -> None:
        """Take back vLLM's GPU memory before a batch. The learner's freed blocks stay in torch's caching allocator
        until they are handed back to the driver, and vLLM allocates outside that cache: without ``empty_cache``
        a wake after a learner step can run out of memory that torch holds but no longer uses."""
        self._serving += 1
        if self._sleeping:
            release_cached_gpu_memory()
            await self.loop.wait(self.loop.call(lambda: self.llm.wake_up()), "waking the engine")
            self._sleeping = False

    async def sleep(self) -> None:
        """Free vLLM's GPU memory until the next batch (``sample.engine_sleep`` on a GPU) once no service of the
        engine is running (a run's evaluation may end while its rollout goes on)."""
        self._serving -= 1
        if self._serving == 0 and self.sample.engine_sleep and torch.cuda.is_available() and not self._sleeping:
            await self.loop.wait(self.loop.call(lambda: self.llm.sleep(level=1)), "putting the engine to sleep")
            self._sleeping = True

    def metrics(self) -> dict[str, float]:
        metrics = dict(self._counters)
        self._counters = dict.fromkeys(self._counters, 0.0)
        metrics["engine/turns_interrupted"], self.loop.interrupted = float(self.loop.interrupted), 0
        return metrics

    def close(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.close()
        llm = getattr(self, "llm", None)
        if llm is not None:
            self.llm = None
            try:
                llm.engine_core.shutdown()
            finally:
                _release_distributed()
        shutil.rmtree(self._folder, ignore_errors=True)


def _release_distributed() -> None:
    """vLLM sets up a one-process torch.distributed group; release it so a later engine can start."""
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    except ImportError:
        return
    cleanup_dist_env_and_memory()


class WeightPull:
    """Newer weights from ``sync`` loaded by ``load(version)``, once for all requests asking meanwhile, in a task
    that a request cancelled while it waits (an interrupted group) does not cancel: ``sync`` hands each version
    once, so a cancelled load would leave the engine on old weights with nothing new to pull."""

    def __init__(self, sync: Callable[[], int | None] | None, load: Callable[[int], Awaitable[None]]):
        self.sync, self.load = sync, load
        self._task: asyncio.Future | None = None

    async def __call__(self) -> None:
        if self.sync is None:
            return
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._pull())
        await asyncio.shield(self._task)

    async def _pull(self) -> None:
        version = await asyncio.to_thread(self.sync)
        if version is not None:
            await self.load(version)


class VLLMService:
    """The service surface (``running``, ``episode``, ``generate``, ``policy_version``, ``pop_batches``) on a
    ``VLLMEngine``."""

    def __init__(
        self,
        engine: VLLMEngine,
        policy: LMPolicy,
        params: SamplingParams,
        generator: torch.Generator | None,
        sync: Callable[[], int | None] | None,
    ):
        self.engine, self.params, self.generator, self.sync = engine, params, generator, sync
        self.policy = policy  # whose weights this service's versions are
        self.policy_version = engine.version  # the driver sets it before running (sequential schedule)
        self.batches: list[int] = []
        self.generate_seconds = 0.0
        self.turns = 0  # generate requests answered
        self.prefill_tokens = 0  # context tokens the model ran (not found in the prefix cache)
        self._pull = WeightPull(sync, self.load_version)

    @property
    def batches_and_seconds(self) -> tuple[list[int], float]:
        sizes, seconds = self.engine.loop.pop_steps()
        self.batches += sizes
        self.generate_seconds += seconds
        return self.batches, self.generate_seconds

    def pop_batches(self) -> tuple[list[int], float]:
        """Sizes of the engine's steps (requests advanced together) and their seconds since the last call."""
        sizes, seconds = self.batches_and_seconds
        self.batches, self.generate_seconds = [], 0.0
        return sizes, seconds

    @asynccontextmanager
    async def running(self):
        """Serve for the duration of the block: with the weights of ``policy_version`` when there is no ``sync``."""
        await self.engine.wake()
        try:
            if self.sync is None and self.policy_version != self.engine.version:
                await self.engine.load(self.policy_version, self.policy.model)
            yield self
        finally:
            self.batches_and_seconds  # noqa: B018 — collect the steps of this block
            await self.engine.sleep()

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
        """Sample one turn continuing ``context_ids`` (``order`` is the hf engine's row order; unused here);
        ``params`` (optional) replaces the service's sampling parameters for this request; ``role``: sample with
        that role's adapter (``agent.role_policy: adapters``; None: the model's one adapter, if any)."""
        await self._pull()
        policy, params = self.policy, params or self.params
        budget = max_new_tokens
        if policy.context_length is not None:
            if len(context_ids) >= policy.context_length:
                raise ValueError(
                    f"a context of {len(context_ids)} tokens leaves no room for a completion in the "
                    f"model's {policy.context_length}-token context; lower sample.max_prompt_length "
                    "and, for multi-turn tasks, agent.max_total_tokens"
                )
            budget = min(budget, policy.context_length - len(context_ids))
        seed = params.seed
        if seed is None and self.generator is not None:
            seed = request_seed(self.generator)
        sampling = vllm_sampling(
            params, max_tokens=budget, seed=seed, eos_ids=policy.eos_ids, interruptible=self.engine.partial
        )
        loop = asyncio.get_running_loop()
        answer = loop.create_future()

        def done(output, error) -> None:  # on the engine's thread; weights change only between requests
            try:
                loop.call_soon_threadsafe(_settle, answer, (output, self.engine.version), error)
            except RuntimeError:  # the episodes' event loop has closed: no one waits for this answer
                pass

        lora = (lambda: self.engine.current_adapter(role)) if self.engine.lora else None  # the version's when it joins
        request_id = self.engine.loop.submit(list(context_ids), sampling, done, lora=lora)
        try:
            output, version = await self.engine.loop.wait(answer, "a turn")
        except (asyncio.CancelledError, WaitTimeout):
            self.engine.loop.abort(request_id)
            raise
        return self._turn(output, version, params)

    def _turn(self, output, version: int, params: SamplingParams) -> TurnOutput:
        completion = output.outputs[0]
        ids = list(completion.token_ids)
        logprobs = [entry[token].logprob for entry, token in zip(completion.logprobs or [], ids)]
        self.turns += 1
        self.prefill_tokens += len(output.prompt_token_ids) - (output.num_cached_tokens or 0)
        policy = self.policy
        text = cut_at_stop(policy.decode(ids), params.stop, params.keep_stop)
        finish = "length" if completion.finish_reason == "length" else "stop"
        first, changes = turn_versions(getattr(output, "pauses", ()), version, len(ids))
        ended_with_eos = bool(ids) and ids[-1] in set(policy.eos_ids)
        return TurnOutput(ids, logprobs, text, finish, ended_with_eos, first, engine="vllm", version_changes=changes)

    async def load_version(self, version: int) -> None:
        """Load the weights ``sync`` handed as ``version`` (once the requests in flight have finished)."""
        self.policy_version = version
        await self.engine.load(version, self.policy.model)


def request_seed(generator: torch.Generator) -> int:
    """A request's sampling seed, drawn from ``generator`` on the generator's own device: a Ray rollout worker on a
    GPU hands a CUDA generator, which torch refuses for a draw on the CPU."""
    return int(torch.randint(2**31 - 1, (1,), generator=generator, device=generator.device))


def _settle(future: asyncio.Future, result, error) -> None:
    if future.done():  # its episode was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class SharedVLLM:
    """A runner's handle on the process's vLLM engine for its model: runners of one run (rollout, evaluation) share
    it, each loading its own policy's weights by version (versions only grow; a turn is stamped with the version vLLM
    held). The engine closes with its last handle. The engines in a process are one run's: one, or with a model per
    role one per ``role`` (``vllm_roles``)."""

    name = "vllm"
    _engines: dict[tuple, list] = {}  # key → [engine, handles]
    _lock = threading.Lock()

    def __init__(self, policy: LMPolicy, config, role: str | None = None):
        self.policy = policy
        run = (config.model.name, config.model.dtype, config.model.lora_rank, config.seed)
        self._key = (*run, role)
        with self._lock:
            if any(key[:-1] != run for key in self._engines):
                raise ValueError(
                    "a vllm engine for another model is running in this process; close its runs "
                    "first (one vllm engine per process)"
                )
            if self._key not in self._engines:
                self._engines[self._key] = [VLLMEngine(policy, config), 0]
            self._engines[self._key][1] += 1
            self.core: VLLMEngine | None = self._engines[self._key][0]

    @property
    def version(self) -> int:
        return self.core.version

    def service(
        self,
        params: SamplingParams,
        generator: torch.Generator | None,
        *,
        batch_wait: float | None = None,
        max_batch: int = 0,
        sync: Callable[[], int | None] | None = None,
    ) -> VLLMService:
        """A service for a batch of episodes (``batch_wait`` and ``max_batch`` are the hf engine's: vLLM batches
        continuously)."""
        return VLLMService(self.core, self.policy, params, generator, sync)

    def metrics(self) -> dict[str, float]:
        return self.core.metrics()

    def close(self) -> None:
        with self._lock:
            if self.core is None:
                return
            entry, self.core = self._engines[self._key], None
            entry[1] -= 1
            if entry[1] == 0:
                del self._engines[self._key]
                entry[0].close()


def release_cached_gpu_memory() -> None:
    """Hand the blocks torch's CUDA allocator caches but no tensor uses back to the driver (no-op without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
