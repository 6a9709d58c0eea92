"""The event loop episodes run on, which ends even when some of its tasks never do.

``asyncio.run`` cancels the tasks still pending when its coroutine returns, then waits for every one of them to
end, and waits for its default executor's threads too. One task that catches its ``CancelledError`` and carries
on (a tool call or an external agent's ``run`` given up at its timeout) or one thread that never returns keeps
it waiting for ever: the update never ends and a stop request never gets its turn. ``run_abandoning`` runs a
coroutine as ``asyncio.run`` does, except that after the coroutine ends (returned, raised, or was interrupted)
the tasks left over are cancelled and given ``grace`` seconds to end, then left as they are: the loop is closed
with them still pending. A task left behind is kept referenced and marked not to be reported, so it prints
nothing later; the loop's default executor (``asyncio.to_thread``) runs each call on a daemon thread, so a call
that never returns does not keep the process from exiting either.

``EpisodeLoop`` runs one batch of episodes after another on one loop in the same way, and keeps that loop open
between batches while no batch leaves a task running: what an agent's code ties to its event loop (the
connections of an async HTTP client, a framework's cached client) lasts the whole run. A batch that leaves a task
running gives up its loop as ``run_abandoning`` does, and the next batch starts a fresh one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from unipg.envs.service import DaemonThreads

T = TypeVar("T")

LEFTOVER_GRACE_SECONDS = 1.0  # how long tasks still running when episodes end get to honour their cancellation

_left_behind: list[asyncio.Task] = []  # tasks of closed loops; never collected, so their coroutines never close


class _LoopThreads(concurrent.futures.ThreadPoolExecutor):
    """The loop's default executor: each call on a daemon thread of its own (``DaemonThreads``), and a record of
    the calls still running. A ``ThreadPoolExecutor`` only because asyncio accepts no other kind as default; it
    starts none of that class's threads, which the interpreter would wait for at exit."""

    def __init__(self):
        super().__init__(max_workers=1)
        self._threads = DaemonThreads("unipg-loop")
        self.running: set[concurrent.futures.Future] = set()

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future = self._threads.submit(fn, *args, **kwargs)
        self.running.add(future)
        future.add_done_callback(self.running.discard)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Nothing to stop: a call still running keeps its daemon thread until it returns."""


def run_abandoning(
    main: Coroutine[Any, Any, T],
    *,
    grace: float = LEFTOVER_GRACE_SECONDS,
    on_left: Callable[[int], None] | None = None,
) -> T:
    """``main``'s result on a new event loop, as ``asyncio.run`` gives it, but never waiting longer than ``grace``
    for what is left running once ``main`` has ended (module docstring); ``on_left(n)`` is told how many tasks
    were left running, when there are any."""
    return EpisodeLoop(keep=False).run(main, grace=grace, on_left=on_left)


class EpisodeLoop:
    """Batches of episodes on one event loop, each ended as ``run_abandoning`` ends its loop's run; the loop is
    kept for the next batch (``keep``) unless a batch left a task running. ``close`` closes it."""

    def __init__(self, *, keep: bool = True):
        self.keep = keep
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: _LoopThreads | None = None
        self._busy = threading.Lock()  # held while a batch runs on the kept loop

    def run(
        self,
        main: Coroutine[Any, Any, T],
        *,
        grace: float = LEFTOVER_GRACE_SECONDS,
        on_left: Callable[[int], None] | None = None,
    ) -> T:
        """``main``'s result, as ``run_abandoning`` gives it; on the kept loop unless another thread is running a
        batch on it (this batch then gets a loop of its own)."""
        if not self._busy.acquire(blocking=False):
            return EpisodeLoop(keep=False).run(main, grace=grace, on_left=on_left)
        try:
            return self._run(main, grace, on_left)
        finally:
            self._busy.release()

    def _run(self, main: Coroutine[Any, Any, T], grace: float, on_left: Callable[[int], None] | None) -> T:
        if self._loop is None:
            self._loop, self._threads = asyncio.new_event_loop(), _LoopThreads()
            self._loop.set_default_executor(self._threads)
        loop, left, kept = self._loop, 0, False
        asyncio.set_event_loop(loop)  # as asyncio.run does, for code that asks for the current loop
        task = loop.create_task(main)
        try:
            return loop.run_until_complete(task)
        finally:
            try:
                left = _end_leftovers(loop, self._threads, grace, keep=self.keep)
                kept = self.keep and not left
            finally:
                if task.done() and not task.cancelled():
                    task.exception()  # a SystemExit or KeyboardInterrupt that left through the loop: not to log again
                asyncio.set_event_loop(None)
                if not kept:
                    self.close()
            if left and on_left is not None:
                on_left(left)

    def close(self) -> None:
        """Close the kept loop (a later ``run`` starts a new one)."""
        if self._loop is not None:
            self._loop.close()
        self._loop = self._threads = None


def _end_leftovers(loop: asyncio.AbstractEventLoop, threads: _LoopThreads, grace: float, *, keep: bool) -> int:
    """Cancel the loop's pending tasks, wait up to ``grace`` seconds for them (and for the executor's running
    calls, which may still use what the next update changes), close async generators within what is left of
    it unless the loop is to be kept (``keep``) and no task is left; leave what is still running
    (``_left_behind``) and return how many tasks that is."""
    deadline = time.monotonic() + grace
    pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in pending:
        task.cancel()
    try:
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=grace))
        if keep and all(task.done() for task in asyncio.all_tasks(loop)):
            concurrent.futures.wait(list(threads.running), timeout=max(deadline - time.monotonic(), 0.0))
            return 0
        generators = loop.create_task(loop.shutdown_asyncgens())
        loop.run_until_complete(asyncio.wait({generators}, timeout=max(deadline - time.monotonic(), 0.01)))
        concurrent.futures.wait(list(threads.running), timeout=max(deadline - time.monotonic(), 0.0))
        left = [task for task in asyncio.all_tasks(loop) if not task.done()]
        for task in left:
            task._log_destroy_pending = False  # a task given up on purpose is no error to report when collected
            _left_behind.append(task)
        return len([task for task in left if task is not generators])
    finally:  # also when a task's SystemExit or KeyboardInterrupt leaves through the loop while it waits
        for task in pending:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: an error of a task given up on is expected, not to be logged
