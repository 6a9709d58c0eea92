"""The actors of the Ray backend (``unipg.runtime.backends.ray_lm``): environment actors that run tool calls, the
rollout workers' view of them, and the rollout workers that run episodes on their own copy of the policy.

Imported only when a run uses ``backend: ray``; each actor process imports this module.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from unipg.envs.service import run_tool
from unipg.learn.state import generator_state, restore_generator
from unipg.policy.adapters import load_synced_state
from unipg.sample.episodes import EpisodeRunner
from unipg.sample.roles import role_major
from unipg.tools.base import Tool, ToolError, current_attempt, set_attempt

try:
    import ray
    from ray.exceptions import ObjectLostError, RayActorError, WorkerCrashedError
except ImportError:  # pragma: no cover — the message is the point
    raise ValueError("backend 'ray' needs Ray: pip install 'unipg[ray]' (or set backend=inprocess)") from None

LOST = (RayActorError, WorkerCrashedError, ObjectLostError)  # the actor, its process or its results are gone


# ----------------------------------------------------------------------------------------------------------
# Environment actors


_CALL = contextvars.ContextVar("unipg_call", default=None)


class _TrackedThreads(ThreadPoolExecutor):
    """A thread pool that knows which call each busy thread runs (a thread cannot be stopped)."""

    def __init__(self, max_workers: int):
        super().__init__(max_workers=max_workers, thread_name_prefix="unipg-tool")
        self.busy: dict[object, float] = {}

    def submit(self, fn, /, *args, **kwargs):
        call = _CALL.get()

        def tracked():
            self.busy[call] = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy.pop(call, None)

        return super().submit(tracked)


class EnvActor:
    """Runs tool calls for rollout workers; many at once (an async actor, synchronous tools on threads)."""

    def __init__(self, tools: dict[str, Tool], max_threads: int = 64):
        self.tools = tools
        self.threads = _TrackedThreads(max_threads)
        self.calls: dict[object, asyncio.Task] = {}

    async def ready(self) -> int:
        return os.getpid()

    async def call(self, call_id, name: str, arguments: dict, delay: float, attempt: int = 1) -> tuple[str, str]:
        """("ok", output text) or ("refused", the ``ToolError`` message); other exceptions propagate.
        ``attempt``: the caller's retry counter, which the tool sees as ``current_attempt()``."""
        _CALL.set(call_id)
        set_attempt(attempt)
        self.calls[call_id] = asyncio.current_task()
        try:
            return "ok", await run_tool(self.tools[name], arguments, delay, self.threads)
        except ToolError as refusal:
            return "refused", str(refusal)
        finally:
            self.calls.pop(call_id, None)

    async def abandon(self, call_id, grace: float) -> bool:
        """Stop a call its caller gave up on. A synchronous tool's thread cannot be stopped: if it is still in
        the call after ``grace`` seconds, the actor exits, so that Ray starts it afresh (exactly once, however
        many callers notice); returns whether it does."""
        task = self.calls.get(call_id)
        if task is not None:
            task.cancel()
        deadline = time.monotonic() + grace
        while call_id in self.threads.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if call_id not in self.threads.busy:
            return False
        asyncio.get_running_loop().call_later(0.1, os._exit, 1)  # after this answer has gone out
        return True


class EnvPool:
    """A rollout worker's view of the environment actors: the ``remote`` of its ``EnvironmentService``."""

    def __init__(self, actors: list, *, health_timeout: float, worker: int = 0):
        self.actors, self.health_timeout = actors, health_timeout
        self.in_flight = [0] * len(actors)
        self.restarts = 0  # restarts this pool caused since the last report
        self._killed = [0.0] * len(actors)  # when this pool last killed each actor
        self._ids = (f"{worker}-{n}" for n in itertools.count())
        self._checks: set[asyncio.Task] = set()

    async def call(self, name: str, arguments: dict, delay: float) -> str:
        index = min(range(len(self.actors)), key=self.in_flight.__getitem__)
        actor, call_id = self.actors[index], next(self._ids)
        self.in_flight[index] += 1
        try:
            status, text = await actor.call.remote(call_id, name, arguments, delay, current_attempt())
        except asyncio.CancelledError:  # the service's timeout: free the actor from the call
            check = asyncio.get_running_loop().create_task(self._abandon(index, call_id))
            self._checks.add(check)
            check.add_done_callback(self._checks.discard)
            raise
        except LOST as error:
            raise RuntimeError(f"environment actor {index} is unavailable ({type(error).__name__})") from None
        finally:
            self.in_flight[index] -= 1
        if status == "refused":
            raise ToolError(text)
        return text

    async def _abandon(self, index: int, call_id) -> None:
        actor, grace = self.actors[index], min(1.0, self.health_timeout / 2)
        try:
            restarting = await asyncio.wait_for(
                asyncio.wrap_future(actor.abandon.remote(call_id, grace).future()), self.health_timeout
            )
        except LOST:
            return  # restarting already
        except (asyncio.TimeoutError, TimeoutError):  # its event loop does not answer: kill it (once a while)
            if time.monotonic() - self._killed[index] < self.health_timeout * 3:
                return
            self._killed[index] = time.monotonic()
            ray.kill(actor, no_restart=False)  # Ray starts it again; the calls it held fail and are retried
            restarting = True
        self.restarts += restarting

    def pop_restarts(self) -> int:
        restarts, self.restarts = self.restarts, 0
        return restarts


# ----------------------------------------------------------------------------------------------------------
# Rollout workers


class RolloutWorker:
    """Runs groups of episodes on its own copy of the policy (an async actor: many groups at once); the episodes
    of an external agent (``task.agent``) call the endpoint the worker serves on its own loopback."""

    def __init__(self, setup: tuple, index: int, env_actors: list, health_timeout: float, fetch_timeout: float):
        from unipg.runtime.setup import seed_everything, set_threads

        policy, task, config, tools, reward_fn = setup  # one object-store reference, fetched once per worker
        seed_everything(config.seed + index, config.deterministic)
        set_threads(config)
        if ray.get_gpu_ids():
            policy.model.to("cuda")
        pool = EnvPool(env_actors, health_timeout=health_timeout, worker=index) if env_actors else None
        self.pool = pool
        self.runner = EpisodeRunner(policy, task, config, reward_fn, tools=tools, remote_tools=pool)
        self.group_size, self.fetch_timeout = config.sample.samples_per_prompt, fetch_timeout
        self.serial, self._pending = 0, None  # the publication loaded or about to be
        self.generator = torch.Generator(policy.device).manual_seed(config.seed * 7919 + index + 1)
        self.engine, self.loop, self._running = None, None, None
        self._starting = asyncio.Lock()  # the first groups wait together until the loop serves

    async def ready(self) -> dict:
        """Where the worker runs: its Ray node's id and address, and its process."""
        node_id = ray.get_runtime_context().get_node_id()
        return {"node_id": node_id, "node_ip": ray.util.get_node_ip_address(), "pid": os.getpid()}

    async def _receive(self, weights: tuple[int, int, list] | None) -> None:
        """Take the learner's newest publication, fetched from the object store only if the worker lacks it."""
        if weights is None or weights[0] <= self.serial:
            return
        serial, version, (ref,) = weights
        state = await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.fetch_timeout)
        if serial > self.serial:
            self.serial, self._pending = serial, (version, state)

    def _load(self) -> int | None:
        """Load received weights (between generate calls); returns their version, or None."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        load_synced_state(self.runner.policy.model, pending[1])
        return pending[0]

    def _report(self, sizes: list[int], seconds: float) -> dict:
        service = self.runner.service
        return {
            "sizes": sizes,
            "seconds": seconds,
            "service": service.pop_stats() if service is not None else None,
            "agent": self.runner.agent_stats.pop() if self.runner.external is not None else None,
            "env_restarts": self.pool.pop_restarts() if self.pool is not None else 0,
        }

    async def run_batch(self, examples: list, version: int, weights, state: str) -> tuple[list, str, dict]:
        """The sequential schedule: run ``examples`` (one episode each) with the generator in ``state``, as
        the in-process backend does; returns the trajectories (a multi-role task's: every role's, episode by episode), the generator's new state and a report."""
        await self._receive(weights)
        self._load()
        generator = returned = restore_generator(torch.Generator(), state)
        if self.runner.policy.device.type != "cpu":  # sample with a device generator seeded from the state
            seed = int(torch.randint(2**62, (1,), generator=returned))
            generator = torch.Generator(self.runner.policy.device).manual_seed(seed)
        episodes = await self.runner.arun(examples, generator=generator, policy_version=version, all_roles=True)
        report = self._report(episodes.batch_sizes, episodes.generate_seconds)
        return episodes.trajectories, generator_state(returned), report

    async def run_group(self, example, order: int, weights) -> tuple[list, dict]:
        """The concurrent schedule: one group of episodes of ``example`` on the worker's shared engine."""
        await self._receive(weights)
        async with self._starting:  # the loop runs until close: the engine's batching worker (and an external
            if self.loop is None:  # agent's endpoint, on this node's loopback); no group uses it before it serves
                engine = self.runner.inference_service(self.generator, sync=self._load)
                loop = self.runner.agent_loop(engine)
                running = loop.running()
                await running.__aenter__()
                self.engine, self.loop, self._running = engine, loop, running
        episodes = [
            self.loop.run_episode(self.runner.make_env(), example, order=order * self.group_size + i)
            for i in range(self.group_size)
        ]
        finished = list(await asyncio.gather(*episodes))
        trajectories = role_major(finished) if self.runner.roles else finished  # a multi-role task's, role after role
        return trajectories, self._report(*self.engine.pop_batches())

    async def close(self) -> None:
        """Stop what ``run_group`` started (an external agent's endpoint, the engine's batching worker) and the
        runner's engine and environment service, before the actor is killed."""
        running, self._running, self.engine, self.loop = self._running, None, None, None
        try:
            if running is not None:
                await running.__aexit__(None, None, None)
        finally:
            self.runner.close()
