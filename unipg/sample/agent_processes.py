"""External agents in processes of their own (``endpoint.agent_processes``).

An external agent's Python (its OpenAI client, its framework's models and callbacks, httpx) costs 5-10 ms of CPU
per model call. On the thread of ``unipg.sample.agent_thread`` that time is spent on the GIL the inference engine's
decode loop and the endpoint's server need too, so requests reach the engine late and split its batches. With
``endpoint.agent_processes`` > 0 each attempt's ``run`` is played instead in one of that many worker processes,
started (``spawn``) when the runner is built and kept for the run: one long-lived event loop per process, on which
the agent's clients and connections last as they do on the agents' thread.

Only the call crosses the process boundary: the episode's base URL, its session key and its example go to a
worker, and what ``run`` returned (or the exception it raised) comes back. Everything an episode records (the
token ids, log-probs and tool results of its calls) is recorded by the endpoint in this process, as it is for an
agent on the thread. ``ProcessAgent`` is the ``run`` of such an agent on the episodes' side: awaiting it plays one
attempt in the least busy worker, so ``ExternalAgentLoop`` times it out, retries and scores it as any agent's
``run``. Its cancellation (``endpoint.agent_timeout``) cancels the attempt's task in the worker. A worker that
dies (a crash, ``os._exit`` in an agent) fails its attempts as ``Stranded``: they start again, in fresh sessions,
on a worker started in its place, without counting as retries.

A worker runs its agents on one event loop: an agent that blocks that loop holds up the others of its worker
until their timeouts fail them (the agents' thread, ``endpoint.agent_processes: 0``, gives such an agent a fresh
loop instead).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing
import pickle
import threading

from unipg.sample.agent_thread import AgentThreads

logger = logging.getLogger(__name__)

STOP_SECONDS = 5.0  # how long a worker gets to end its agents and exit when the runner closes


class WorkerDied(RuntimeError):
    """The worker process playing an attempt ended before the attempt did."""


class AgentProcess:
    """One worker process and the attempts it plays: ``submit`` one, its ``Future`` holds what ``run`` returned
    (or raised); a reader thread collects the worker's answers."""

    def __init__(self, spec: str):
        context = multiprocessing.get_context("spawn")  # forking a process with the engine's threads is unsafe
        self.connection, child = context.Pipe()
        self.process = context.Process(target=serve_agents, args=(spec, child), name="unipg-agents", daemon=True)
        self.process.start()
        child.close()
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.jobs = itertools.count()
        self.lock = threading.Lock()  # guards ``pending``, ``alive`` and sends
        self.alive = True
        self.reader = threading.Thread(target=self._read, name="unipg-agents-reader", daemon=True)
        self.reader.start()

    def submit(self, base_url: str, api_key: str, example) -> tuple[int, concurrent.futures.Future]:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            if not self.alive:
                future.set_exception(WorkerDied("the agents' worker process has ended"))
                return -1, future
            job = next(self.jobs)
            self.pending[job] = future
            self.connection.send(("run", job, base_url, api_key, example))
        return job, future

    def cancel(self, job: int) -> None:
        with self.lock:
            if self.alive and job in self.pending:
                self.connection.send(("cancel", job))

    def _read(self) -> None:
        while True:
            try:
                kind, job, value = self.connection.recv()
            except (EOFError, OSError):
                break
            with self.lock:
                future = self.pending.pop(job, None)
            if future is None or future.done():
                continue
            if kind == "done":
                future.set_result(value)
            elif kind == "raised":
                future.set_exception(value)
            else:
                future.cancel()
        with self.lock:
            self.alive = False
            pending, self.pending = self.pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(WorkerDied(f"the agents' worker process ended (exit code {self.exit_code()})"))

    def exit_code(self) -> int | None:
        self.process.join(0.1)
        return self.process.exitcode

    def close(self) -> None:
        """Tell the worker to end its agents and exit; kill it if it has not after ``STOP_SECONDS``."""
        with self.lock:
            if self.alive:
                try:
                    self.connection.send(None)
                except OSError:
                    pass
        self.process.join(STOP_SECONDS)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.connection.close()
        self.reader.join()


class ProcessAgent:
    """The ``run`` of an external agent played in ``processes`` worker processes (module docstring)."""

    def __init__(self, spec: str, processes: int):
        self.spec = spec
        self.workers = [AgentProcess(spec) for _ in range(processes)]
        self.lock = threading.Lock()

    def worker(self) -> AgentProcess:
        """The worker with the fewest attempts in play; a dead one is replaced by a fresh worker first."""
        with self.lock:
            for index, worker in enumerate(self.workers):
                if not worker.alive:
                    logger.warning(
                        "an agents' worker process ended (exit code %s); starting another", worker.exit_code()
                    )
                    self.workers[index] = AgentProcess(self.spec)
            return min(self.workers, key=lambda worker: len(worker.pending))

    async def __call__(self, base_url: str, api_key: str, example):
        from unipg.sample.endpoint_agents import Stranded

        worker = self.worker()
        job, future = worker.submit(base_url, api_key, example)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            worker.cancel(job)
            raise
        except WorkerDied as died:
            raise Stranded(str(died)) from None

    def close(self) -> None:
        for worker in self.workers:
            worker.close()


class AgentProcesses(AgentThreads):
    """A runner's agents' thread, on which each attempt's ``ProcessAgent`` call waits, and the worker processes
    that play the attempts (``agent``); closing it ends both."""

    def __init__(self, spec: str, processes: int):
        super().__init__()
        self.agent = ProcessAgent(spec, processes)

    def close(self) -> None:
        super().close()
        self.agent.close()


def agent_threads(spec: str | None, endpoint) -> AgentThreads:
    """Where a runner's external agent ``spec`` runs: with ``endpoint.agent_processes`` > 0, worker processes
    (``AgentProcesses``), else the agents' thread of this process."""
    if spec and endpoint.agent_processes:
        return AgentProcesses(spec, endpoint.agent_processes)
    return AgentThreads()


def played_by(threads: AgentThreads, run):
    """The ``run`` an episode awaits: the workers' ``ProcessAgent`` when ``threads`` has workers, else ``run``."""
    return threads.agent if isinstance(threads, AgentProcesses) else run


def serve_agents(spec: str, connection) -> None:
    """A worker process: play the attempts ``connection`` brings with the agent ``spec`` names, on one event loop,
    until told to stop or the runner's end of the pipe closes."""
    from unipg.sample.endpoint_agents import load_agent

    run = load_agent(spec)
    asyncio.run(_serve(run, connection))


async def _serve(run, connection) -> None:
    loop = asyncio.get_running_loop()
    tasks: dict[int, asyncio.Task] = {}
    stopped = asyncio.Event()

    def start(job: int, base_url: str, api_key: str, example) -> None:
        task = loop.create_task(run(base_url, api_key, example))
        tasks[job] = task
        task.add_done_callback(lambda ended: ended_attempt(job, ended))

    def ended_attempt(job: int, task: asyncio.Task) -> None:
        del tasks[job]
        _answer(connection, job, task)

    def cancel(job: int) -> None:
        if job in tasks:
            tasks[job].cancel()

    def read() -> None:
        while True:
            try:
                message = connection.recv()
            except (EOFError, OSError):
                message = None
            if message is None:
                loop.call_soon_threadsafe(stopped.set)
                return
            kind, job, *arguments = message
            loop.call_soon_threadsafe(start if kind == "run" else cancel, job, *arguments)

    threading.Thread(target=read, name="unipg-agents-requests", daemon=True).start()
    await stopped.wait()
    for task in tasks.values():
        task.cancel()
    if tasks:
        await asyncio.wait(list(tasks.values()), timeout=STOP_SECONDS)


def _answer(connection, job: int, task: asyncio.Task) -> None:
    """Send an ended attempt's outcome: what ``run`` returned, the exception it raised (as raised when it can be
    pickled, else a ``RuntimeError`` naming it), or its cancellation."""
    if task.cancelled():
        message = ("cancelled", job, None)
    elif task.exception() is not None:
        message = ("raised", job, _sendable(task.exception()))
    else:
        message = ("done", job, task.result())
    try:
        connection.send(message)
    except (pickle.PicklingError, TypeError, AttributeError) as error:
        what = f"the agent returned a {type(message[2]).__name__}, which cannot be sent between processes ({error})"
        connection.send(("raised", job, RuntimeError(what)))
    except OSError:
        pass  # the runner has gone


def _sendable(error: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 — any failure to pickle: send its name and text instead
        return RuntimeError(f"{type(error).__name__}: {error}")
