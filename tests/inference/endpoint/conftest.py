"""An endpoint on the embedded model, served from an event loop on a background thread."""

import asyncio
import contextlib
import threading
from types import SimpleNamespace

import pytest

from tests.helpers.endpoint import make_loop


@pytest.fixture(scope="module")
def policy(tiny_policy):
    return tiny_policy()


@contextlib.contextmanager
def serving(loop):
    """``loop`` (an ExternalAgentLoop) serving on a background thread: ``loop``, and ``call(coroutine)`` that runs
    on its event loop."""
    event_loop = asyncio.new_event_loop()
    ready, stop = threading.Event(), None

    async def serve():
        nonlocal stop
        stop = asyncio.Event()
        async with loop.running():
            ready.set()
            await stop.wait()

    thread = threading.Thread(target=event_loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(60)

    def call(coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, event_loop).result(60)

    try:
        yield SimpleNamespace(loop=loop, call=call)
    finally:
        event_loop.call_soon_threadsafe(stop.set)
        thread.join(30)


@pytest.fixture(scope="module")
def served(policy):
    """A running endpoint with small bounds (4 KiB bodies, 4 choices)."""
    with serving(make_loop(policy, max_body_bytes=4096, max_n=4)) as running:
        yield running


@pytest.fixture(scope="module")
def served_roomy(policy):
    """A running endpoint that takes bodies of up to 64 KiB (room for hostile histories)."""
    with serving(make_loop(policy, max_body_bytes=1 << 16, max_n=4)) as running:
        yield running
