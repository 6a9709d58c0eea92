"""The episodes' event loop ends even when some of its tasks never do: tasks that swallow every cancellation and
executor calls that never return are left behind after the grace, counted, silent, and the process still exits."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.helpers.endpoint import make_loop
from unipg.sample.endpoint_agents import ExternalAgent
from unipg.sample.event_loop import EpisodeLoop, run_abandoning
from unipg.tasks.base import Example
from unipg.tasks.rewards.rules import build_rewards

GUARD_SECONDS = 60  # only a failure guard: the script ends in a second or two once its imports are done


async def swallow_every_cancellation(started: asyncio.Event) -> None:
    """A badly written tool: it catches every cancellation and waits on, for ever."""
    started.set()
    while True:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            continue


def test_a_task_that_swallows_every_cancellation_is_left_behind_and_counted():
    left = []

    async def main() -> str:
        started = asyncio.Event()
        asyncio.create_task(swallow_every_cancellation(started))
        asyncio.create_task(asyncio.sleep(3600))  # a leftover that honours its cancellation: not counted
        await started.wait()
        return "episodes"

    assert run_abandoning(main(), grace=0.05, on_left=left.append) == "episodes"
    assert left == [1]


def test_an_interrupt_inside_the_loop_still_leaves_it_and_the_leftovers_behind():
    async def main() -> None:
        started = asyncio.Event()
        asyncio.create_task(swallow_every_cancellation(started))
        await started.wait()
        raise KeyboardInterrupt  # what a signal handler raises while the loop runs

    with pytest.raises(KeyboardInterrupt):
        run_abandoning(main(), grace=0.05)


def test_an_executor_call_that_never_returns_is_not_waited_for():
    blocked, release = threading.Event(), threading.Event()

    def stuck() -> None:
        blocked.set()
        release.wait()

    async def main() -> None:
        asyncio.get_running_loop().run_in_executor(None, stuck)
        await asyncio.to_thread(blocked.wait)

    run_abandoning(main(), grace=0.05)
    release.set()


def test_a_kept_loop_serves_batch_after_batch_until_one_leaves_a_task_running():
    kept, left, loops = EpisodeLoop(), [], []

    async def batch(stuck: bool) -> None:
        loops.append(asyncio.get_running_loop())
        if stuck:
            started = asyncio.Event()
            asyncio.create_task(swallow_every_cancellation(started))
            await started.wait()

    for stuck in (False, False, True, False):
        kept.run(batch(stuck), grace=0.05, on_left=left.append)
    kept.close()
    assert loops[0] is loops[1] is loops[2] and loops[3] is not loops[2] and loops[2].is_closed()
    assert left == [1]


async def agent_that_never_ends(base_url, api_key, example):
    """An external agent's ``run`` that catches every cancellation and goes on."""
    await swallow_every_cancellation(asyncio.Event())


def test_an_external_agent_that_swallows_every_cancellation_fails_its_episode_and_is_left_behind(tiny_policy):
    loop, left = make_loop(tiny_policy(), agent_timeout=0.2, agent_retries=0), []
    example = Example("What is 2*3?", "6", "6", {"answer": "6"})
    agent = ExternalAgent(agent_that_never_ends, build_rewards([{"name": "math"}]))
    [episode] = run_abandoning(loop.run_episodes([agent], [example]), grace=0.05, on_left=left.append)
    assert episode.finish == "failed" and "ran past" in episode.infos[-1].agent_error
    assert loop.stats.timeouts == 1 and left == [1]


SCRIPT = """
import asyncio, threading
from unipg.sample.event_loop import EpisodeLoop, run_abandoning

async def swallow_every_cancellation():
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            continue

async def main():
    asyncio.create_task(swallow_every_cancellation())
    asyncio.get_running_loop().run_in_executor(None, threading.Event().wait)  # a thread that never returns
    await asyncio.sleep(0)
    return "done"

print(run_abandoning(main(), grace=0.1), flush=True)
"""


def test_the_process_exits_silently_with_a_task_and_a_thread_left_running():
    """``asyncio.run`` would wait for both for ever; here the process prints, exits 0 and writes no warning."""
    root = Path(__file__).resolve().parents[2]
    child = subprocess.Popen(
        [sys.executable, "-c", SCRIPT], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        output, errors = child.communicate(timeout=GUARD_SECONDS)
    finally:
        child.kill()
    assert (child.returncode, output.strip(), errors) == (0, "done", "")


def test_a_task_that_exits_passes_its_system_exit_on_once_and_logs_nothing(caplog):
    """``sys.exit()`` in one of several gathered tasks (a tool or reward calling it) leaves the loop as the
    ``SystemExit`` it is, for the caller to report, and asyncio does not log it again as never retrieved."""
    import gc

    async def exits():
        await asyncio.sleep(0)
        sys.exit(3)

    async def main():
        return await asyncio.gather(exits(), exits())

    codes = []
    try:
        run_abandoning(main())
    except SystemExit as exit:  # not kept: its traceback would keep the tasks from being collected
        codes.append(exit.code)
    gc.collect()
    assert codes == [3]
    assert "never retrieved" not in caplog.text
