"""Symbolic comparison of two final answers (math_verify, then sympy), in child interpreters, bounded in time.

A symbolic library cannot be interrupted inside the trainer: ``gamma(10**7)`` or ``binomial(10**9, 10**8)`` pass
the size checks of ``symbolic_refusal`` yet hold an interpreter for seconds to minutes. So ``symbolic_equal`` runs
in child interpreters (``IsolatedFunction``), and ``SymbolicPool.compare`` gives a batch of comparisons:

- up to ``workers`` children computing in parallel;
- ``timeout`` seconds per comparison: its child is killed at that limit;
- ``batch_timeout`` seconds for the whole batch, starting killed children again included: a comparison still
  waiting or computing at the deadline is abandoned;
- a comparison cut at either limit is "not shown equal" (the ``math`` reward scores it 0.0) and counted in
  ``SymbolicPool.undecided`` (with comparisons whose child failed);
- the calling thread only waits: the children are driven by daemon threads, so a caller that gives up (an
  exception, Ctrl-C, an abandoned episode) leaves nothing the process waits for at exit, and children still
  running are killed at exit (``shut_down``); a coroutine waits through ``in_daemon_thread``, so the event loop
  runs on meanwhile and neither it nor the process waits for a call its caller gave up.

Verdicts are remembered (the last ``CACHE_SIZE``), so a comparison asked twice (the ``math`` reward, then the
episode's ``correct`` flag) is computed once.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import os
import queue
import re
import threading
import time
from collections import OrderedDict

from unipg.tools.bounded import IsolatedFunction

SYMBOLIC_TIMEOUT = 5.0  # seconds one comparison may compute before its child is killed
BATCH_TIMEOUT = 30.0  # seconds one batch of comparisons may take in all, starting children included
WORKERS = max(1, min(4, os.cpu_count() or 1))  # children computing at once
START_TIMEOUT = 120.0  # seconds a child may take to import its libraries (within the batch's deadline)
CACHE_SIZE = 4096  # verdicts remembered
PRELOAD = ("sympy", "math_verify")  # imported by a child before it is ready: a comparison's limit is its own
_KILL_MARGIN = 1.0  # seconds past the deadline for killing a child and reading its end


class SymbolicPool:
    """Children comparing answers with ``symbolic_equal``, shared by every batch of the process."""

    def __init__(self, *, workers: int = WORKERS):
        if workers < 1:
            raise ValueError(f"symbolic comparison needs at least 1 worker, got {workers}")
        self.undecided = 0  # comparisons cut at their own or their batch's limit, or failed (scored as not equal)
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self._children = [IsolatedFunction(f"{__name__}:symbolic_equal", preload=PRELOAD) for _ in range(workers)]
        for child in self._children:
            self._free.put(child)
        self._verdicts: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self._shut = threading.Event()
        atexit.register(self.shut_down)

    def compare(
        self,
        pairs: list[tuple[str, str]],
        *,
        tolerance: float,
        timeout: float = SYMBOLIC_TIMEOUT,
        batch_timeout: float = BATCH_TIMEOUT,
    ) -> list[bool]:
        """Whether each ``(predicted, reference)`` pair is shown equal; False where a limit cut it."""
        deadline = time.monotonic() + batch_timeout
        keys = [(predicted, reference, tolerance) for predicted, reference in pairs]
        with self._lock:
            verdicts = {key: self._verdicts[key] for key in keys if key in self._verdicts}
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        for key in dict.fromkeys(key for key in keys if key not in verdicts):
            jobs.put(key)
        threads = [
            threading.Thread(target=self._drain, args=(jobs, verdicts, timeout, deadline), daemon=True)
            for _ in range(min(jobs.qsize(), len(self._children)))
        ]
        for thread in threads:
            thread.start()
        # a thread's waits end by the deadline, a child restarted late may run past it: it is abandoned then,
        # finishing (into the cache) or cut at its own limit in the background
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()) + _KILL_MARGIN)
        with self._lock:
            found = [verdicts.get(key) for key in keys]
            self.undecided += sum(verdict is None for verdict in dict(zip(keys, found)).values())
        return [bool(verdict) for verdict in found]

    def _drain(self, jobs: queue.SimpleQueue, verdicts: dict, timeout: float, deadline: float) -> None:
        """One thread of a batch: compare its pairs on a free child until none is left or the deadline passes."""
        while (left := deadline - time.monotonic()) > 0 and not self._shut.is_set():
            try:
                key = jobs.get_nowait()
                child = self._free.get(timeout=left)
            except queue.Empty:
                return
            try:
                child.timeout, child.start_timeout = min(timeout, left), min(START_TIMEOUT, left)
                verdict = bool(child(*key))
            except Exception:  # noqa: BLE001 — killed at a limit (TimeoutError) or its process failed: undecided
                continue
            finally:
                self._free.put(child)
            with self._lock:
                verdicts[key] = self._verdicts[key] = verdict
                while len(self._verdicts) > CACHE_SIZE:
                    self._verdicts.popitem(last=False)

    def shut_down(self) -> None:
        """Kill every child and start none again (at exit: comparisons still running end undecided)."""
        self._shut.set()
        for child in self._children:
            child.close()


_POOL: SymbolicPool | None = None
_POOL_LOCK = threading.Lock()


def symbolic_pool() -> SymbolicPool:
    """The process's pool, started on first use."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = SymbolicPool()
        return _POOL


async def in_daemon_thread(function, /, *args, **kwargs):
    """``function(*args, **kwargs)`` on a daemon thread of its own, awaited. Unlike ``asyncio.to_thread``, whose
    threads ``asyncio.run`` joins when it ends, a call given up (its caller cancelled) holds neither the loop's
    end nor the process's exit; it runs on until its own bound."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(function(*args, **kwargs))
        except BaseException as error:  # noqa: BLE001 — handed to the waiting coroutine
            future.set_exception(error)

    threading.Thread(target=run, name="unipg-symbolic", daemon=True).start()
    return await asyncio.wrap_future(future)


def symbolic_equal(predicted: str, reference: str, tolerance: float) -> bool:
    """``math_verify``'s verdict when it parses both answers, else sympy's; runs in a child of ``SymbolicPool``."""
    verdict = math_verify_equal(predicted, reference)
    return verdict if verdict is not None else _sympy_equal(predicted, reference, tolerance=tolerance)


def math_verify_equal(predicted: str, reference: str) -> bool | None:
    """Whether ``math_verify`` shows the two answers equal; None when it cannot parse one of them. Each is read
    as LaTeX math first (``$...$``: plain "1/\\sqrt{2}" would be read as 1), then as plain text."""
    from math_verify import parse, verify

    # math_verify enforces its timeouts with SIGALRM, which only the main thread may install.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None

    def parsed(text: str) -> list:
        """math_verify's reading of ``text``; empty unless it found an expression (not only the text itself)."""
        for candidate in (f"${text}$", text):
            found = parse(candidate, parsing_timeout=timeout)
            if any(not isinstance(item, str) for item in found):
                return found
        return []

    try:
        gold, target = parsed(reference), parsed(predicted)
        if not gold or not target:
            return None
        return bool(verify(gold, target, timeout_seconds=timeout))
    except Exception:  # any failure to compare means "not shown equal"
        return False


# sympy parses by evaluating Python, so only plain arithmetic is let through: digits, operators, brackets,
# sqrt and pi. Powers are left out because "9**9**9**9" would hang the comparison.
_SAFE_EXPRESSION = re.compile(r"[\d\s.+\-*/()]+")


def _sympy_equal(predicted: str, reference: str, *, tolerance: float) -> bool:
    """|predicted − reference| ≤ tolerance after sympy evaluates both plain arithmetic expressions."""
    import sympy

    for text in (predicted, reference):
        if len(text) > 100 or "**" in text or not _SAFE_EXPRESSION.fullmatch(re.sub(r"sqrt|pi", "", text)):
            return False
    try:
        difference = sympy.sympify(predicted, rational=True) - sympy.sympify(reference, rational=True)
        return abs(complex(sympy.N(difference))) <= tolerance
    except Exception:  # SympifyError, TypeError, SyntaxError, ZeroDivisionError, ...: not shown equal
        return False
