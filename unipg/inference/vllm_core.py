"""The thread that drives an in-process vLLM engine: requests go in one by one, the engine steps them together.

vLLM's ``AsyncLLM`` runs its engine core in a separate process; the in-process ``LLMEngine`` stepped by one
thread batches just as continuously (a request joins the running batch at the next step, a finished one leaves
it), keeps the model in this process, where new weights load by reference, and leaves no process behind.

Every use of the engine happens on this thread: ``submit`` and ``abort`` queue a request change, ``call`` queues
a function (loading weights, sleeping) that runs once no request is in flight, so a turn is always sampled by
one weights version, and requests submitted after it wait until it ran.

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

import torch

from unipg.config.timeouts import WaitTimeout

_STOP = ("stop",)


class StepLoop:
    """Steps ``llm`` (a vLLM ``LLMEngine``) on its own thread (module docstring)."""

    def __init__(self, llm, timeout: float = 600.0):
        """``timeout``: seconds without progress after which ``wait`` gives up (``sample.engine_timeout``)."""
        self.llm, self.timeout = llm, timeout
        self._progress = time.monotonic()  # when the thread last took a step or applied a command
        self.step_sizes: list[int] = []  # requests that advanced in each step, since the last pop
        self.step_seconds = 0.0  # wall time inside steps, since the last pop
        self._commands: queue.Queue = queue.Queue()
        self._in_flight: dict[str, Callable] = {}  # request id → callback(output, error)
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
        self._put(("abort", request_id))

    def call(self, fn: Callable) -> concurrent.futures.Future:
        """Run ``fn()`` on the loop once no request is in flight; its result or exception in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put(("call", fn, future))
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
            if command[0] == "call" and self._in_flight:
                return True
            waiting.popleft()
            if command is _STOP:
                for command in waiting:  # calls queued behind the stop do not run
                    if command[0] == "call":
                        command[2].cancel()
                return False
            if command[0] == "add":
                _, request_id, prompt_ids, params, done, lora = command
                try:
                    self.llm.add_request(
                        request_id,
                        {"prompt_token_ids": prompt_ids},
                        params,
                        lora_request=lora() if lora is not None else None,
                    )
                except Exception as error:  # noqa: BLE001 — a bad request fails its caller, not the loop
                    done(None, error)
                else:
                    self._in_flight[request_id] = done
            elif command[0] == "abort":
                if self._in_flight.pop(command[1], None) is not None:
                    self.llm.abort_request([command[1]])
            elif command[0] == "call" and command[2].set_running_or_notify_cancel():
                try:
                    command[2].set_result(command[1]())
                except Exception as error:  # noqa: BLE001 — handed to the caller
                    command[2].set_exception(error)
        return True

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
            if output.finished and output.request_id in self._in_flight:
                self._in_flight.pop(output.request_id)(output, None)

    def _fail_all(self, error: BaseException) -> None:
        if self._in_flight:
            try:
                self.llm.abort_request(list(self._in_flight))
            except Exception:  # noqa: BLE001 — the engine may be the thing that failed
                pass
        for done in self._in_flight.values():
            done(None, error)
        self._in_flight.clear()
