"""The thread external agents run on: an event loop of their own, apart from the one of the episodes.

An external agent's ``run`` is the user's code, and code that blocks its event loop (``time.sleep``, a synchronous
HTTP client inside ``async def``) stops everything else on that loop. So agents do not run on the loop of the
episodes, where the endpoint's server, the inference engine's batching and each attempt's timeout run: they run on
an ``AgentThread``, an event loop on a daemon thread of its own, kept for the whole run (an agent's async client
and its connections last the run). However long an agent blocks, the endpoint keeps answering, the engine keeps
sampling for the other episodes, and ``endpoint.agent_timeout`` fires on time.

A watchdog thread notices when the agents' loop has not run its heartbeat for ``block_seconds``. It logs a warning
naming the function that blocks it, and the loop is given up (``stalled``): later attempts go to a fresh
``AgentThread``, and the attempts caught on the blocked loop, except the one blocking it, start again there in
fresh sessions (``endpoint_agents.Stranded``). The attempt that blocks runs on until it returns or its timeout
fails it; the blocked loop ends once it has no attempt left, its thread then with it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import selectors
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path

from unipg.sample.event_loop import LEFTOVER_GRACE_SECONDS, _end_leftovers, _LoopThreads

logger = logging.getLogger(__name__)

BLOCK_SECONDS = 5.0  # a loop that runs no callback for this long is blocked by an agent
BEATS_PER_BLOCK = 4  # heartbeats per ``block_seconds``: how soon after that a block is noticed
_RUNTIME_FILES = (str(Path(asyncio.__file__).parent), threading.__file__, __file__)  # frames that are not the agent's


def call_soon_threadsafe(loop: asyncio.AbstractEventLoop, callback: Callable[[], object]) -> None:
    """``callback`` on ``loop`` from any thread; nothing when the loop has closed (its episodes are over)."""
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:
        pass


@dataclass
class Played:
    """One agent coroutine on an ``AgentThread``."""

    outcome: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)  # set when it ends
    task: asyncio.Task | None = None  # its task, once the agents' loop has started it
    cancelled: bool = False  # cancel requested before it started


class AgentThread:
    """An event loop on a daemon thread running agents' coroutines, watched for blocks (module docstring)."""

    def __init__(self, *, block_seconds: float = BLOCK_SECONDS):
        self.block_seconds = block_seconds
        self.loop = asyncio.new_event_loop()
        self.threads = _LoopThreads()  # calls to threads that never return keep no exit waiting
        self.loop.set_default_executor(self.threads)
        self.stalled = threading.Event()  # set once a block was noticed: no new attempt comes here
        self.blocker: asyncio.Task | None = None  # the task that was running when the block was noticed
        self.playing: dict[asyncio.Task, Played] = {}
        self._lock = threading.Lock()
        self._on_stall: set[Callable[[], None]] = set()
        self._closed = threading.Event()
        self._stopped = False  # the loop was told to stop (on its own thread)
        self._beat = time.monotonic()
        self.thread = threading.Thread(target=self._serve, name="unipg-agents", daemon=True)
        self.thread.start()
        threading.Thread(target=self._watch, name="unipg-agents-watchdog", daemon=True).start()

    def submit(self, coroutine: Coroutine) -> Played:
        """Run ``coroutine`` on this loop; its ``Played`` says when it ends and how."""
        played = Played()

        def start() -> None:
            task = self.loop.create_task(coroutine)
            played.task, self.playing[task] = task, played
            task.add_done_callback(lambda ended: self._ended(ended, played))
            if played.cancelled:
                task.cancel()

        try:
            self.loop.call_soon_threadsafe(start)
        except RuntimeError:  # closed meanwhile
            coroutine.close()
            played.outcome.set_exception(RuntimeError("the agents' event loop has closed"))
        return played

    def cancel(self, played: Played) -> None:
        """Cancel ``played`` on this loop (as soon as it runs again, when it is blocked)."""

        def cancel() -> None:
            played.cancelled = True
            if played.task is not None:
                played.task.cancel()

        call_soon_threadsafe(self.loop, cancel)

    def on_stall(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Have ``callback`` called (on the watchdog's thread) when a block is noticed; returns its remover."""
        with self._lock:
            self._on_stall.add(callback)
        return lambda: self._on_stall.discard(callback)

    def close(self) -> None:
        """End the loop once no attempt is left on it (now, when none is)."""
        self._closed.set()
        call_soon_threadsafe(self.loop, self._stop_when_idle)

    def _ended(self, task: asyncio.Task, played: Played) -> None:
        del self.playing[task]
        if task.cancelled():
            played.outcome.cancel()
        elif task.exception() is not None:
            played.outcome.set_exception(task.exception())
        else:
            played.outcome.set_result(task.result())
        if self._closed.is_set():
            self._stop_when_idle()

    def _stop_when_idle(self) -> None:
        # once only: a second stop left queued (by ``close`` when an attempt's end stopped the loop first) would
        # otherwise run inside the cleanup's run_until_complete and stop it before it completes
        if not self.playing and not self._stopped:
            self._stopped = True
            self.loop.stop()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._heartbeat)
        try:
            self.loop.run_forever()
        finally:
            # what the agents' libraries left running (a client's background worker) is cancelled and given
            # LEFTOVER_GRACE_SECONDS to end before the loop closes; what ignores that is left behind
            _end_leftovers(self.loop, self.threads, LEFTOVER_GRACE_SECONDS, keep=False)
            self.loop.close()

    def _heartbeat(self) -> None:
        self._beat = time.monotonic()
        self.loop.call_later(self.block_seconds / BEATS_PER_BLOCK, self._heartbeat)

    def _watch(self) -> None:
        while not self._closed.wait(self.block_seconds / BEATS_PER_BLOCK):
            blocked = time.monotonic() - self._beat
            if blocked < self.block_seconds or waiting_for_events(self.thread.ident):
                continue  # a loop waiting in its selector is idle: a late beat there is a process short of CPU
            self.blocker = asyncio.current_task(self.loop)
            logger.warning(
                "the agent's event loop was blocked for %.1f s in %s; use an async client or run blocking calls in "
                "a thread (asyncio.to_thread). Episodes go on on a fresh event loop; the attempts caught on the "
                "blocked one start again there",
                blocked,
                blocking_function(self.thread.ident),
            )
            self.stalled.set()
            with self._lock:
                callbacks = list(self._on_stall)
            for callback in callbacks:
                callback()
            self.close()
            return


def waiting_for_events(thread_id: int | None) -> bool:
    """Whether the thread ``thread_id`` is waiting in its event loop's selector (the loop is idle, not blocked)."""
    frame = sys._current_frames().get(thread_id)
    return frame is not None and frame.f_code.co_filename == selectors.__file__


def blocking_function(thread_id: int | None) -> str:
    """Where the thread ``thread_id`` runs agent code: the outermost frame of its stack that belongs to neither
    asyncio nor threading, as ``function (file:line)``."""
    frame = sys._current_frames().get(thread_id)
    stack = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    for frame in reversed(stack):
        if not frame.f_code.co_filename.startswith(_RUNTIME_FILES):
            return f"{frame.f_code.co_qualname} ({frame.f_code.co_filename}:{frame.f_lineno})"
    return "code outside any agent function"


class AgentThreads:
    """The ``AgentThread`` of a run's external agents, replaced by a fresh one when its loop was blocked."""

    def __init__(self, *, block_seconds: float = BLOCK_SECONDS):
        self.block_seconds = block_seconds
        self._current: AgentThread | None = None
        self._lock = threading.Lock()

    def current(self) -> AgentThread:
        """The thread new attempts run on."""
        with self._lock:
            if self._current is None or self._current.stalled.is_set():
                self._current = AgentThread(block_seconds=self.block_seconds)
            return self._current

    def close(self) -> None:
        """End the current thread's loop once its attempts have ended (a later ``current`` starts a new one)."""
        with self._lock:
            if self._current is not None:
                self._current.close()
            self._current = None
