"""The environment service: the one place tool calls go through, so one bad tool never stalls training.

Agents in a batch call tools whose latency ranges from milliseconds to seconds and which time out, raise,
or answer with something that is not text. The service turns every one of those outcomes into an
observation the episode can continue from:

- each attempt runs under ``timeout`` seconds (the tool's declared latency model included);
- a failed attempt (timeout, exception, an answer that is neither text nor JSON-serializable) is retried
  up to ``retries`` more times, waiting ``backoff`` seconds and doubling the wait after each failure;
- after the last failure the episode gets ``default_observation`` and a reward of ``-failure_penalty``;
- a ``ToolError`` is the tool refusing a call it understood (bad expression, empty query): its message is
  the observation, it is not retried, and it does not cost the failure penalty.

A tool that hangs costs its episode no more than the timeout. Each attempt of a synchronous tool runs on a
daemon thread of its own, so a call that never returns keeps only that thread (Python cannot kill a thread),
later calls still find threads, and the process can exit with it still stuck. An ``async`` tool that swallows
its cancellation is abandoned rather than awaited, here and when the episodes' event loop ends
(``unipg.sample.event_loop``). ``abandoned`` counts the attempts left running either way. Tools that may hang for good are still better ``async`` or run in a subprocess, as the Python sandbox
does — or in other processes altogether: with ``remote`` (an object
with ``async call(name, arguments, delay) -> str``, e.g. the Ray backend's pool of environment actors) every
attempt runs there, and the service keeps its policy here (timeouts, retries, latency draws, default
observation, penalties).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import random
import threading
import time
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

from unipg.tools.base import TOOL_SPEC_KEYS, Tool, ToolError, attempt_number, build_entry


@dataclass
class ToolCallResult:
    """What one tool call gave the episode."""

    observation: str  # the text the agent sees next
    status: str  # "ok", "error" (the tool refused the call: ToolError) or "failed" (every attempt failed)
    attempts: int  # 1 + retries used
    timeouts: int  # attempts that ran past the timeout
    seconds: float  # wall time of the call, retries and backoff included
    penalty: float  # reward to add for this call (−failure_penalty when failed, else 0)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class ServiceStats:
    """Counts since the last ``pop``; logged as rollout metrics."""

    calls: int = 0
    successes: int = 0
    errors: int = 0
    failures: int = 0
    timeouts: int = 0
    retries: int = 0
    seconds: float = 0.0
    by_tool: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, result: ToolCallResult) -> None:
        self.calls += 1
        self.successes += result.status == "ok"
        self.errors += result.status == "error"
        self.failures += result.status == "failed"
        self.timeouts += result.timeouts
        self.retries += result.attempts - 1
        self.seconds += result.seconds
        self.by_tool[name] = self.by_tool.get(name, 0) + 1

    def merge(self, other: ServiceStats) -> None:
        """Add ``other``'s counts (the stats of services in other processes)."""
        for name in ("calls", "successes", "errors", "failures", "timeouts", "retries", "seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name, count in other.by_tool.items():
            self.by_tool[name] = self.by_tool.get(name, 0) + count

    def metrics(self, prefix: str) -> dict[str, float]:
        return {
            f"{prefix}/tool_timeouts": self.timeouts,
            f"{prefix}/tool_retries": self.retries,
            f"{prefix}/tool_failures": self.failures,
            f"{prefix}/tool_errors": self.errors,
            f"{prefix}/tool_seconds": self.seconds / max(self.calls, 1),
        }


def build_tools(specs: list[dict]) -> dict[str, Tool]:
    """Tools by the name the policy calls them by, built from ``[{"name": ..., "options": {...}, "latency": {...}}]``
    with the ``TOOLS`` registry: an entry's tool is offered under the entry's name (``build_entry``). ``latency``
    (optional) takes ``LatencyModel`` fields, e.g. ``{kind: lognormal, seconds: 0.2}``; ``server`` (the ``mcp``
    entry's) is the process serving the tools. An entry may build several tools, named by themselves (every
    tool of an MCP server); two tools of one name are refused, and what is built is closed again when a later entry
    fails."""
    import unipg.tools  # noqa: F401  (registers the built-in tools)

    tools: dict[str, Tool] = {}
    try:
        for spec in specs:
            if not isinstance(spec, dict) or "name" not in spec or set(spec) - set(TOOL_SPEC_KEYS):
                raise ValueError(
                    f"a tool spec is {{name: ..., options: {{...}}, latency: {{...}}}} (an mcp tool also "
                    f"takes server: {{command: ..., args: [...]}}), got {spec}"
                )
            built = build_entry(spec["name"], spec_options(spec))
            taken = [one.name for one in built if one.name in tools]
            if taken:
                close_tools({str(index): one for index, one in enumerate(built)})
                raise ValueError(
                    f"two tool entries offer a tool named '{taken[0]}' (the second: {spec['name']}); "
                    "a call names one tool, so keep one of them"
                )
            for one in built:
                tools[one.name] = _with_latency(one, spec)
    except BaseException:
        close_tools(tools)
        raise
    return tools


def spec_options(spec: dict) -> dict:
    """The keyword arguments of a tool spec's factory: its ``options``, and its ``server`` when it has one."""
    options = dict(spec.get("options") or {})
    if "server" in spec:
        options["server"] = spec["server"]
    return options


def _with_latency(built: Tool, spec: dict) -> Tool:
    import dataclasses

    from unipg.tools.base import LatencyModel

    if spec.get("latency") is None:
        return built
    try:
        return dataclasses.replace(built, latency=LatencyModel(**spec["latency"]))
    except TypeError as error:
        raise ValueError(
            f"tool '{spec['name']}': latency takes kind, seconds, sigma, alpha; got {spec['latency']}"
        ) from error


def close_tools(tools: dict[str, Tool]) -> None:
    """Release what the tools hold (MCP server processes), each holder once."""
    for close in {id(tool.close): tool.close for tool in tools.values() if tool.close is not None}.values():
        close()


class DaemonThreads(Executor):
    """An executor that runs each call on a new daemon thread: no thread is shared, so one stuck call delays
    no other, and none is joined when the process exits."""

    def __init__(self, thread_name_prefix: str = "unipg-tool"):
        self.thread_name_prefix = thread_name_prefix

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        context = contextvars.copy_context()  # the tool sees the attempt number, as an async tool does

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(context.run(fn, *args, **kwargs))
            except BaseException as error:  # noqa: BLE001 — handed to the waiting coroutine
                future.set_exception(error)

        threading.Thread(target=run, name=self.thread_name_prefix, daemon=True).start()
        return future


class _Garbage(Exception):
    """The tool returned something that is neither text nor JSON-serializable."""


async def run_tool(tool: Tool, arguments: dict, delay: float, threads: Executor) -> str:
    """One attempt of ``tool``: its latency ``delay``, then the function (a sync one on ``threads``); the
    output as text. Raises what the tool raises, or ``_Garbage`` for an output that is not text."""
    if delay:
        await asyncio.sleep(delay)
    if tool.is_async:
        output = await tool.function(**arguments)
    else:
        output = await asyncio.get_running_loop().run_in_executor(threads, lambda: tool.function(**arguments))
    if isinstance(output, str):
        return output
    if output is None:
        raise _Garbage("the tool returned nothing")
    try:
        return json.dumps(output)
    except (TypeError, ValueError):
        raise _Garbage(f"the tool returned a {type(output).__name__}, not text") from None


class EnvironmentService:
    """Runs tool calls with a timeout, bounded retries with backoff, and a default observation on failure."""

    def __init__(
        self,
        tools: dict[str, Tool],
        *,
        timeout: float = 10.0,
        retries: int = 2,
        backoff: float = 0.05,
        default_observation: str = "tool unavailable",
        failure_penalty: float = 0.1,
        max_output_chars: int = 1000,
        max_threads: int = 64,
        seed: int = 0,
        remote=None,
    ):
        self.tools, self.remote = dict(tools), remote
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.default_observation, self.failure_penalty = default_observation, failure_penalty
        self.max_output_chars = max_output_chars
        self.stats = ServiceStats()
        self._rng = random.Random(seed)  # latency draws: reproducible experiments
        self.max_threads = max_threads  # kept for callers that pass it; each sync attempt has its own thread
        self.abandoned = 0  # attempts still running when their timeout passed (sync threads, async tasks)
        self._threads = DaemonThreads()

    @classmethod
    def from_specs(cls, specs: list[dict], **options) -> EnvironmentService:
        """A service over the tools named in ``[{"name": ..., "options": {...}}]``."""
        return cls(build_tools(specs), **options)

    async def call(self, name: str, arguments: dict) -> ToolCallResult:
        """Run tool ``name``; never raises for anything the tool does."""
        start, attempts, timeouts = time.monotonic(), 0, 0
        tool = self.tools[name]
        while True:
            attempts += 1
            try:
                output = await self._timed_attempt(tool, arguments, attempts)
                result = ToolCallResult(output, "ok", attempts, timeouts, time.monotonic() - start, 0.0)
                break
            except ToolError as refusal:
                result = ToolCallResult(
                    self._clip(f"error: {refusal}"), "error", attempts, timeouts, time.monotonic() - start, 0.0
                )
                break
            except Exception as failure:  # noqa: BLE001 — any tool failure must become an observation
                timeouts += isinstance(failure, (asyncio.TimeoutError, TimeoutError))
                if attempts > self.retries:
                    result = ToolCallResult(
                        self.default_observation,
                        "failed",
                        attempts,
                        timeouts,
                        time.monotonic() - start,
                        -self.failure_penalty,
                    )
                    break
                await asyncio.sleep(self.backoff * 2 ** (attempts - 1))
        self.stats.add(name, result)
        return result

    async def _timed_attempt(self, tool: Tool, arguments: dict, attempt: int) -> str:
        """One attempt, or ``TimeoutError`` after ``timeout`` seconds. An attempt still running then is cancelled
        but not awaited: a tool that swallows the cancellation must not hold the episode past its timeout."""
        with attempt_number(attempt):  # the task copies this context
            task = asyncio.ensure_future(self._attempt(tool, arguments))
        try:
            done, _ = await asyncio.wait({task}, timeout=self.timeout)
        except asyncio.CancelledError:  # the episode itself was cancelled: so is its attempt
            task.cancel()
            raise
        if task in done:
            return task.result()
        task.cancel()
        task.add_done_callback(_retrieve)  # its eventual exception is expected; don't log it as unretrieved
        self.abandoned += 1
        raise TimeoutError(f"tool '{tool.name}' ran past {self.timeout:g} s")

    async def _attempt(self, tool: Tool, arguments: dict) -> str:
        delay = tool.latency.draw(self._rng) if tool.latency is not None else 0.0
        if self.remote is not None:  # the tool's latency is spent where the tool runs
            return self._clip(await self.remote.call(tool.name, arguments, delay))
        return self._clip(await run_tool(tool, arguments, delay, self._threads))

    def _clip(self, text: str) -> str:
        """At most ``max_output_chars`` characters (a marker says how many were cut), as valid UTF-8: lone
        surrogates, which a tool decoding bytes carelessly can return, would fail in the tokenizer."""
        if len(text) > self.max_output_chars:
            text = text[: self.max_output_chars] + f"... [{len(text) - self.max_output_chars} more characters]"
        return text.encode("utf-8", "replace").decode("utf-8")

    def pop_stats(self) -> ServiceStats:
        stats, self.stats = self.stats, ServiceStats()
        return stats

    def close(self) -> None:
        """Stop the tools' servers (MCP); nothing else to wait for: threads of stuck calls are daemons, and do not
        keep the process alive."""
        self._threads.shutdown(wait=False, cancel_futures=True)
        close_tools(self.tools)


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()
