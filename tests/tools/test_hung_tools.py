"""Hung tools cost their episode the timeout and nothing more: a synchronous tool that never returns, and an
async tool that swallows its cancellation, both time out on time; later calls still run; the episodes' event
loop ends without waiting for them; the process exits."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from unipg.envs import EnvironmentService
from unipg.envs.service import build_tools
from unipg.tools import tool

GUARD_SECONDS = 30  # only a failure guard; the calls themselves take about the timeout


@tool
def echo(text: str) -> str:
    """Repeat the text."""
    return text


def service_with(max_threads: int = 64, **rates) -> EnvironmentService:
    tools = build_tools([{"name": "faulty", "options": {"tool": "calculator", "hang_seconds": 60, **rates}}])
    return EnvironmentService({**tools, "echo": echo}, timeout=0.2, retries=0, backoff=0.01, max_threads=max_threads)


def test_more_blocked_sync_calls_than_threads_all_time_out_and_a_later_call_succeeds():
    threads = 2
    service = service_with(max_threads=threads, hang_sync_rate=1.0)

    async def calls():
        hung = await asyncio.gather(*(service.call("calculator", {"expression": f"{n}+1"}) for n in range(threads + 1)))
        return hung, await service.call("echo", {"text": "still here"})

    start = time.monotonic()
    hung, later = asyncio.run(calls())
    assert time.monotonic() - start < GUARD_SECONDS
    assert [(r.status, r.timeouts) for r in hung] == [("failed", 1)] * (threads + 1)
    assert all(r.seconds < 0.2 + 1.0 for r in hung)  # each cut at its timeout, not queued behind the others
    assert later.ok and later.observation == "still here"
    assert service.abandoned == threads + 1 and service.tools["calculator"].injected["hang_sync"] == threads + 1
    service.close()


def test_an_async_call_that_swallows_cancellation_times_out_on_time():
    tools = build_tools(
        [{"name": "faulty", "options": {"tool": "calculator", "hang_uncancellable_rate": 1.0, "hang_seconds": 2.0}}]
    )
    service = EnvironmentService(tools, timeout=0.2, retries=1, backoff=0.01, failure_penalty=0.5)

    async def timed_call():
        start = time.monotonic()
        result = await service.call("calculator", {"expression": "1+1"})
        return result, time.monotonic() - start

    result, seconds = asyncio.run(timed_call())  # the loop's shutdown waits out the abandoned sleeps (2 s)
    assert seconds < 2 * 0.2 + 1.0 < 2.0  # timed out twice, never waited for the tool
    assert (result.status, result.attempts, result.timeouts, result.penalty) == ("failed", 2, 2, -0.5)
    assert service.stats.timeouts == 2 and service.abandoned == 2


SCRIPT = """
import asyncio
from unipg.envs import EnvironmentService
from unipg.envs.service import build_tools
tools = build_tools([{"name": "faulty", "options": {"tool": "calculator", "hang_sync_rate": 1.0}}])
service = EnvironmentService(tools, timeout=0.2, retries=0)
print(asyncio.run(service.call("calculator", {"expression": "1+1"})).status, flush=True)
"""


def test_the_process_exits_with_a_sync_tool_still_hung():
    root = Path(__file__).resolve().parents[2]
    child = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=root, stdout=subprocess.PIPE, text=True)
    try:
        output, _ = child.communicate(timeout=GUARD_SECONDS + 30)  # the hung call sleeps an hour
    finally:
        child.kill()
    assert (child.returncode, output.strip()) == (0, "failed")


def test_hang_kinds_are_checked():
    with pytest.raises(ValueError, match="cannot be combined"):
        build_tools(
            [
                {
                    "name": "faulty",
                    "options": {"tool": "calculator", "hang_sync_rate": 0.1, "hang_uncancellable_rate": 0.1},
                }
            ]
        )
    with pytest.raises(ValueError, match="hang_sync_rate must be in"):
        build_tools([{"name": "faulty", "options": {"tool": "calculator", "hang_sync_rate": 1.5}}])


RUNNER_SCRIPT = """
import sys
from tests.helpers.scripted import ScriptedEngine
from unipg.config import load_config
from unipg.policy.loading import load_lm_policy
from unipg.policy.tool_calls import tool_parser
from unipg.sample.episodes import EpisodeRunner
from unipg.tasks.base import make_task
from unipg.tasks.rewards.rules import build_rewards

config = load_config(None, [
    "algorithm=grpo", "log.progress=false", "task.name=calculator",
    "task.options={digits: 1, num_train: 4, num_test: 2}",
    "task.tools=[{name: faulty, options: {tool: calculator, hang_uncancellable_rate: 1.0}}]",
    "agent.tool_timeout=0.2", "agent.tool_retries=1", "agent.retry_backoff=0.01",
])
task = make_task(config.task.name, **config.task.options)
runner = EpisodeRunner(load_lm_policy(sys.argv[1]), task, config, build_rewards(task.rewards))

class Service(ScriptedEngine):  # the inference service's interface, answering from a script
    policy_version = 0

    def pop_batches(self):
        return [], 0.0

parser = tool_parser(runner.tool_parser)
call = parser.format_tool_call("calculator", {"expression": "1+1"})
runner.inference_service = lambda *a, **k: Service(runner.policy.tokenizer, [call, "2"], keep_stop=parser.stop)
[episode] = runner.run(task.train[:1], generator=None).trajectories
metrics = runner.pop_service_metrics("rollout")
print(episode.infos[0].tool_status, metrics["rollout/tool_timeouts"], metrics["rollout/tasks_left_running"])
"""


def test_episodes_end_while_a_tool_that_swallows_every_cancellation_runs_on(embedded_path):
    """The faulty tool sleeps an hour through every cancellation: each attempt is given up at its timeout, and
    the episodes' event loop ends without waiting for them, counting them (``asyncio.run`` would wait the hour)."""
    root = Path(__file__).resolve().parents[2]
    child = subprocess.Popen(
        [sys.executable, "-c", RUNNER_SCRIPT, embedded_path],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        output, errors = child.communicate(timeout=GUARD_SECONDS + 30)
    finally:
        child.kill()
    assert child.returncode == 0, errors
    assert output.split() == ["failed", "2", "2"]  # the default observation; both attempts timed out, left running
    assert "Task was destroyed" not in errors and "never awaited" not in errors
