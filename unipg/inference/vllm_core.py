"""The thread that drives an in-process vLLM engine: requests go in one by one, the engine steps them together.

vLLM's ``AsyncLLM`` runs its engine core in a separate process; the in-process ``LLMEngine`` stepped by one
thread batches just as continuously (a request joins the running batch at the next step, a finished one leaves
it), keeps the model in this process, where new weights load by reference, and leaves no process behind.

Every use of the engine happens on this thread: ``submit`` and ``abort`` queue a request change, ``call`` queues
a function (loading weights, sleeping) that runs once no request is in flight, so a turn is always sampled by
one weights version, and requests submitted after it wait until it ran.

An interrupting ``call`` (``interrupt=True``: a weight load with ``runtime.partial_rollouts``) does not wait for the
requests in flight: it takes each one's tokens so far (the engine reports the cumulative output of every running
request submitted with ``RequestOutputKind.CUMULATIVE`` after each step; one reported only when it finishes starts
its turn again), aborts it, runs, and submits it again with those tokens appended to its prompt and its token budget
reduced by them. Its caller gets one output for the whole turn (``ResumedOutput``), whose ``pauses``
say how many of its tokens were sampled before each interruption, and the ``tag`` of that call (the weights
version the tokens before it were sampled by). A resumed request's prompt is computed again under the new weights
(the prefix cache is reset at a load), which is the price of not waiting for the longest turn in flight.

A caller waits on the thread with ``wait``, for as long as the thread makes progress (a step, a command applied):
``timeout`` seconds without any (``sample.engine_timeout``) end the wait with ``WaitTimeout``, so an engine step or
a weight load that never returns fails the turn or the sync waiting on it instead of hanging the run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from unipg.config.timeouts import WaitTimeout

_STOP = ("stop",)
# vLLM's CPU kernels share state between the engines of one process (a model per role runs one engine each):
# two stepping threads in vLLM at once corrupt the heap, so the engines of a process take turns
_IN_VLLM = threading.Lock()


@dataclass
class _Request:
    prompt_ids: list[int]
    params: object  # vLLM's SamplingParams
    done: Callable
    lora: Callable | None
    engine_id: str  # the id vLLM knows it by now (a new one each time it is submitted again)
    token_ids: list[int] = field(default_factory=list)  # sampled before its interruptions
    logprobs: list = field(default_factory=list)  # their log-prob entries, as vLLM gave them
    pauses: list[tuple[int, object]] = field(default_factory=list)  # (tokens sampled before, the call's tag)
    latest: object = None  # its newest unfinished output since it was last submitted


@dataclass
class ResumedCompletion:
    token_ids: list[int]
    logprobs: list
    finish_reason: str | None


@dataclass
class ResumedOutput:
    """The output of a request interrupted by weight loads: its turn's tokens from every submission."""

    request_id: str
    prompt_token_ids: list[int]  # the last submission's prompt (the one whose prefill was computed last)
    num_cached_tokens: int
    outputs: list[ResumedCompletion]
    pauses: list[tuple[int, object]]  # (tokens of the turn sampled before the interruption, its call's tag)
    finished: bool = True


class StepLoop:
    """Steps ``llm`` (a vLLM ``LLMEngine``) on its own thread (module docstring)."""

    def __init__(self, llm, timeout: float = 600.0):
        """``timeout``: seconds without progress after which ``wait`` gives up (``sample.engine_timeout``)."""
        self.llm, self.timeout = llm, timeout
        self._progress = time.monotonic()  # when the thread last took a step or applied a command
        self.step_sizes: list[int] = []  # requests that advanced in each step, since the last pop
        self.step_seconds = 0.0  # wall time inside steps, since the last pop
        self.interrupted = 0  # requests an interrupting call paused and submitted again
        self._commands: queue.Queue = queue.Queue()
        self._in_flight: dict[str, _Request] = {}  # request id → its request (callback(output, error) and all)
        self._outer: dict[str, str] = {}  # the id vLLM knows a request by → its request id
        self._ids = (f"unipg-{n}" for n in itertools.count())
        self._lock = threading.Lock()
        self._closed = False
        self._threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._run, name="unipg-vllm-steps", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: list[int], params, done: Callable, lora=None) -> str:
        """Queue a request; ``done(output, None)`` or ``done(None, error)`` is called on this loop's thread.
        ``lora``: a callable returning the LoRA request current when the request joins (or None)."""
        request_id = next(self._ids)
        self._put(("add", request_id, prompt_ids, params, done, lora))
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request; nothing to do once the loop is closed (closing failed every request in flight)."""
        with self._lock:
            if not self._closed:
                self._commands.put(("abort", request_id))

    def call(self, fn: Callable, *, interrupt: bool = False, tag=None) -> concurrent.futures.Future:
        """Run ``fn()`` on the loop once no request is in flight (``interrupt``: at once, the requests in flight
        interrupted around it and continued after it; ``tag`` is recorded in their pauses); its result or exception
        in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put(("call", fn, future, interrupt, tag))
        return future

    async def wait(self, future: asyncio.Future | concurrent.futures.Future, waiting: str):
        """``future``'s result (a ``call``'s, or a request's answer) while this loop's thread makes progress: once it
        went ``timeout`` seconds without any while ``waiting`` (who waits, for the message) waited, the future is
        cancelled and ``WaitTimeout`` raised."""
        if isinstance(future, concurrent.futures.Future):
            future = asyncio.wrap_future(future)
        start = time.monotonic()
        try:
            while not future.done():
                remaining = max(start, self._progress) + self.timeout - time.monotonic()
                if remaining <= 0:
                    raise WaitTimeout.after(
                        f"the vllm engine's thread ({self._thread.name}) made no progress while {waiting} waited on it",
                        self.timeout,
                        "sample.engine_timeout",
                        "an engine step, or a weight load, sleep or wake on the engine, does not return",
                    )
                await asyncio.wait({future}, timeout=remaining)
        except BaseException:  # given up (timed out, or the waiting task cancelled): a call not yet run never runs
            future.cancel()
            raise
        return future.result()

    def pop_steps(self) -> tuple[list[int], float]:
        with self._lock:
            sizes, seconds = self.step_sizes, self.step_seconds
            self.step_sizes, self.step_seconds = [], 0.0
        return sizes, seconds

    def close(self, timeout: float = 60.0) -> None:
        """Fail requests in flight, stop the thread and wait for it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._commands.put(_STOP)
        self._thread.join(timeout)

    def _put(self, command: tuple) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the vllm engine is closed")
            self._commands.put(command)

    def _run(self) -> None:
        # A new thread starts with OpenMP's default thread count; vLLM's CPU attention checks that the count
        # its metadata was planned with is the one its kernels run with: give this thread torch's.
        torch.set_num_threads(self._threads)
        waiting: deque = deque()
        while True:
            busy = bool(self._in_flight) or bool(waiting)
            try:
                waiting.append(self._commands.get(timeout=None) if not busy else self._commands.get_nowait())
                while True:
                    waiting.append(self._commands.get_nowait())
            except queue.Empty:
                pass
            with _IN_VLLM:
                if not self._admit(waiting):
                    self._fail_all(RuntimeError("the vllm engine was closed while this request ran"))
                    return
                self._progress = time.monotonic()
                if self._in_flight:
                    self._step()
                    self._progress = time.monotonic()

    def _admit(self, waiting: deque) -> bool:
        """Apply queued commands in order; a ``call`` waits for the requests in flight. False on stop."""
        while waiting:
            command = waiting[0]
            if command[0] == "call" and self._in_flight and not (command[3] and self._interruptible()):
                return True
            waiting.popleft()
            if command is _STOP:
                for command in waiting:  # calls queued behind the stop do not run
                    if command[0] == "call":
                        command[2].cancel()
                return False
            if command[0] == "add":
                _, request_id, prompt_ids, params, done, lora = command
                self._add(request_id, _Request(prompt_ids, params, done, lora, request_id))
            elif command[0] == "abort":
                request = self._in_flight.pop(command[1], None)
                if request is not None:
                    del self._outer[request.engine_id]
                    self.llm.abort_request([request.engine_id])
            elif command[0] == "call" and command[2].set_running_or_notify_cancel():
                paused = self._pause(command[4]) if command[3] else []
                try:
                    command[2].set_result(command[1]())
                except Exception as error:  # noqa: BLE001 — handed to the caller
                    command[2].set_exception(error)
                for request_id, request in paused:
                    self._add(request_id, request)
        return True

    def _add(self, request_id: str, request: _Request) -> None:
        done = len(request.token_ids)
        params = request.params if not done else _remaining(request.params, done)
        try:
            self.llm.add_request(
                request.engine_id,
                {"prompt_token_ids": request.prompt_ids + request.token_ids},
                params,
                lora_request=request.lora() if request.lora is not None else None,
            )
        except Exception as error:  # noqa: BLE001 — a bad request fails its caller, not the loop
            request.done(None, error)
        else:
            self._in_flight[request_id] = request
            self._outer[request.engine_id] = request_id

    def _interruptible(self) -> bool:
        """No request in flight follows a grammar (a continuation's would start again from its beginning)."""
        return all(getattr(r.params, "structured_outputs", None) is None for r in self._in_flight.values())

    def _pause(self, tag) -> list[tuple[str, _Request]]:
        """Abort every request in flight, keeping the tokens each sampled so far; returns them to submit again."""
        paused = list(self._in_flight.items())
        self.interrupted += len(paused)
        if paused:
            self.llm.abort_request([request.engine_id for _, request in paused])
        self._in_flight.clear()
        self._outer.clear()
        for request_id, request in paused:
            if request.latest is not None:
                completion = request.latest.outputs[0]
                request.token_ids += list(completion.token_ids)
                request.logprobs += list(completion.logprobs or [])
            request.pauses.append((len(request.token_ids), tag))
            request.latest = None
            request.engine_id = f"{request_id}.{len(request.pauses)}"
        return paused

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            outputs = self.llm.step()
        except Exception as error:  # noqa: BLE001 — the engine failed: every request in flight fails with it
            self._fail_all(error)
            return
        with self._lock:
            self.step_seconds += time.perf_counter() - start
            self.step_sizes.append(len(outputs))
        for output in outputs:
            request_id = self._outer.get(output.request_id)
            if request_id is None:
                continue
            request = self._in_flight[request_id]
            if not output.finished:
                request.latest = output
                continue
            del self._in_flight[request_id], self._outer[output.request_id]
            request.done(_whole(request, output) if request.pauses else output, None)

    def _fail_all(self, error: BaseException) -> None:
        if self._in_flight:
            try:
                self.llm.abort_request([request.engine_id for request in self._in_flight.values()])
            except Exception:  # noqa: BLE001 — the engine may be the thing that failed
                pass
        for request in self._in_flight.values():
            request.done(None, error)
        self._in_flight.clear()
        self._outer.clear()


def _remaining(params, done: int):
    """vLLM sampling parameters for the rest of a turn of which ``done`` tokens were sampled."""
    rest = params.clone()
    rest.max_tokens -= done
    rest.min_tokens = max(rest.min_tokens - done, 0)
    if rest.seed is not None:  # the continuation's draws must not repeat the first part's
        rest.seed = (rest.seed + done) % (2**31 - 1)
    return rest


def _whole(request: _Request, output) -> ResumedOutput:
    """The output of an interrupted request: the tokens of its earlier submissions, then the last one's."""
    completion = output.outputs[0]
    return ResumedOutput(
        request_id=output.request_id,
        prompt_token_ids=list(output.prompt_token_ids),
        num_cached_tokens=output.num_cached_tokens or 0,
        outputs=[
            ResumedCompletion(
                request.token_ids + list(completion.token_ids),
                request.logprobs + list(completion.logprobs or []),
                completion.finish_reason,
            )
        ],
        pauses=request.pauses,
    )


def turn_versions(pauses, final: int, length: int) -> tuple[int, tuple[tuple[int, int], ...]]:
    """The version of a turn's first token and where later versions took over, from the ``pauses`` of a turn that
    weight loads interrupted (``(tokens sampled before, the version they were sampled by)``, ``vllm_core``) and the
    ``final`` version, which sampled the rest of its ``length`` tokens."""
    starts = [0] + [count for count, _ in pauses]
    versions = [version for _, version in pauses] + [final]
    by_start: dict[int, int] = {}
    for start, end, version in zip(starts, starts[1:] + [length], versions):
        if end > start:  # the versions that sampled at least one token
            by_start[start] = version
    if not by_start:
        return final, ()
    first, *later = sorted(by_start.items())
    changes, current = [], first[1]
    for start, version in later:
        if version != current:
            changes.append((start, version))
            current = version
    return first[1], tuple(changes)
