"""An agent that blocks its event loop (a synchronous wait inside ``async def``) stalls neither the endpoint nor
the other episodes, its timeout still fires, and a warning names the function that blocks."""

import asyncio
import logging
import threading

from tests.helpers.endpoint import make_loop
from tests.inference.endpoint import agents_for_tests as agents
from unipg.sample.agent_thread import AgentThreads
from unipg.sample.endpoint_agents import ExternalAgent
from unipg.sample.event_loop import run_abandoning
from unipg.tasks.base import Example
from unipg.tasks.rewards.rules import build_rewards

EXAMPLE = Example("What is 2*3?", "6", "6", {"answer": "6"})
REWARDS = build_rewards([{"name": "math"}])
BLOCK_SECONDS = 0.2  # the watchdog's threshold in these tests


class Warnings(logging.Handler):
    """Keeps the agent thread's warnings; ``logged`` is set by the first."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages, self.logged = [], threading.Event()

    def emit(self, record):
        self.messages.append(record.getMessage())
        self.logged.set()


def blocking_loop(policy, warnings: Warnings, **endpoint):
    loop = make_loop(policy, **endpoint)
    loop.agent_threads = AgentThreads(block_seconds=BLOCK_SECONDS)
    logging.getLogger("unipg.sample.agent_thread").addHandler(warnings)
    return loop


def blocks_until(released: threading.Event):
    async def blocks_its_loop(base_url, api_key, example):
        """Calls the model once, then waits synchronously (a blocking call inside ``async def``)."""
        await agents.two_turns(base_url, api_key, example)
        released.wait()
        return "6"

    return blocks_its_loop


def test_a_blocking_agent_is_named_and_the_other_episode_finishes_while_it_blocks(policy):
    released, warnings = threading.Event(), Warnings()
    loop = blocking_loop(policy, warnings, agent_timeout=300)
    seen = {}

    async def main():
        async with loop.running():
            blocked = asyncio.ensure_future(
                loop.run_episode(ExternalAgent(blocks_until(released), REWARDS), EXAMPLE, 0)
            )
            other = await loop.run_episode(ExternalAgent(agents.two_turns, REWARDS), EXAMPLE, 1)
            seen["warned"], seen["blocked_done"] = list(warnings.messages), blocked.done()
            released.set()
            return other, await blocked

    try:
        other, blocked = asyncio.run(main())
    finally:
        released.set()
        logging.getLogger("unipg.sample.agent_thread").removeHandler(warnings)
    assert other.finish == "done" and not seen["blocked_done"]  # finished while the first agent still blocked
    warning = seen["warned"][0]  # (a later one may name a short block, such as a client loading its certificates)
    assert "the agent's event loop was blocked for" in warning and "blocks_its_loop" in warning
    assert "use an async client or run blocking calls in a thread" in warning
    assert blocked.finish == "done" and loop.stats.failures == 0 and loop.stats.retries == 0


def test_the_timeout_of_an_agent_that_blocks_for_ever_fires(policy):
    released, warnings = threading.Event(), Warnings()
    loop = blocking_loop(policy, warnings, agent_timeout=2 * BLOCK_SECONDS, agent_retries=0)
    left = []
    try:  # as a runner's batch ends: its mirror of the blocked agent, which cannot take its cancellation, is left
        episodes = loop.run_episodes([ExternalAgent(blocks_until(released), REWARDS)], [EXAMPLE])
        [episode] = run_abandoning(episodes, grace=0.05, on_left=left.append)
    finally:
        released.set()
        logging.getLogger("unipg.sample.agent_thread").removeHandler(warnings)
    assert episode.finish == "failed" and "ran past" in episode.infos[-1].agent_error
    assert loop.stats.timeouts == 1


def test_a_background_task_an_agent_left_on_its_loop_is_cancelled_when_the_loop_ends():
    """A client library's background worker (litellm's logging worker, say) started on the agents' loop is
    cancelled and awaited when that loop ends, instead of being collected later on a closed loop."""
    threads = AgentThreads(block_seconds=BLOCK_SECONDS)
    thread = threads.current()
    stopped = threading.Event()

    async def worker(queue: asyncio.Queue):
        try:
            await queue.get()
        except asyncio.CancelledError:
            stopped.set()
            raise

    async def agent_with_a_worker():
        asyncio.get_running_loop().create_task(worker(asyncio.Queue()))
        return "done"

    assert thread.submit(agent_with_a_worker()).outcome.result(timeout=60) == "done"
    threads.close()
    thread.thread.join(timeout=60)
    assert stopped.is_set() and thread.loop.is_closed()


def test_a_second_stop_left_queued_when_the_loop_stopped_does_not_break_its_cleanup():
    """``close`` queues a stop; when the end of the last attempt stopped the loop first, that stop is still queued
    as the loop's cleanup runs it to completion: it must not stop the cleanup, which then closes the loop."""
    threads = AgentThreads(block_seconds=BLOCK_SECONDS)
    thread = threads.current()

    def stop_twice():  # the first stop ends run_forever; the second lands in the loop's next iteration
        thread._stop_when_idle()
        thread.loop.call_soon(thread._stop_when_idle)

    thread.loop.call_soon_threadsafe(stop_twice)
    thread.thread.join(60)
    assert not thread.thread.is_alive() and thread.loop.is_closed()
    threads.close()
