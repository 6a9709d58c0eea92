"""Fault injection, short: training goes on through failing tools, interrupted episodes, a non-finite gradient
and a SIGKILL of the whole process, and loses nothing (the long version is benchmarks/chaos.py)."""

import asyncio
import contextvars
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import unipg.runtime.lm_run as text
from unipg.checkpoint.store import CheckpointStore, load_checkpoint
from unipg.config import load_config
from unipg.envs.service import EnvironmentService, build_tools
from unipg.observe.metrics import read_metrics
from unipg.runtime.lm import train_lm
from unipg.tools import faulty
from unipg.tools.base import current_attempt
from unipg.tools.faulty import FAULT_KINDS

# rates high enough that a few updates meet raising and hanging calls, and calls that fail on every attempt; which
# expressions the policy writes (so which draws it meets) depends on timing, so the rarer kinds may not come up here
# (every kind is checked through the service in the first test)
FAULTY = (
    "task.tools=[{name: faulty, options: {tool: calculator, raise_rate: 0.3, hang_rate: 0.25, "
    "garbage_rate: 0.1, huge_rate: 0.1}}]"
)
# a warm start on tool demonstrations, short enough for a test, after which nearly every episode calls the tool
AGENT = [
    "task.name=calculator",
    "task.options={digits: 1, num_train: 40, num_test: 4, tool_demonstrations: 1.0}",
    "model.warm_start=true",
    "sft.steps=50",
    "sft.batch_size=16",
    "sft.learning_rate=1e-2",
    FAULTY,
    "agent.tool_timeout=0.5",
    "agent.tool_retries=1",
    "agent.retry_backoff=0.01",
    "sample.max_new_tokens=96",
    "agent.max_total_tokens=160",
    "algorithm=grpo",
    "train.batch_size=8",
    "train.mini_batch_size=8",
    "train.micro_batch_size=8",
    "sample.samples_per_prompt=4",
    "eval.every_updates=100",
    "eval.pass_k=0",
    "eval.max_examples=4",
    "log.progress=false",
    "log.tensorboard=false",
]


def faulty_service(**rates) -> EnvironmentService:
    tools = build_tools([{"name": "faulty", "options": {"tool": "calculator", **rates}}])
    return EnvironmentService(tools, timeout=0.2, retries=1, backoff=0.0, max_output_chars=100)


def test_every_tool_fault_becomes_an_observation_within_the_timeout():
    service = faulty_service(raise_rate=0.25, hang_rate=0.25, garbage_rate=0.25, huge_rate=0.25)

    async def timed(n: int):
        start = time.monotonic()
        result = await service.call("calculator", {"expression": f"{n}*3"})
        return result, start, time.monotonic()

    async def calls():
        return await asyncio.gather(*[timed(n) for n in range(40)])

    timed_results = asyncio.run(calls())
    results = [result for result, _, _ in timed_results]
    hung = [(start, end) for result, start, end in timed_results if result.timeouts]
    assert len(hung) > 1 and max(start for start, _ in hung) < min(end for _, end in hung)  # cut, and all at once
    injected = service.tools["calculator"].injected
    assert set(injected) == set(FAULT_KINDS)
    for result in results:
        assert result.status in ("ok", "failed")
        assert len(result.observation) <= 100 + len("... [9999900 more characters]")
        result.observation.encode("utf-8")  # garbage text arrives as valid UTF-8 (no lone surrogates)
    assert service.stats.timeouts == injected["hang"] and service.stats.calls == 40
    service.close()


def test_fault_draws_depend_on_the_attempt_so_retries_can_succeed_and_reruns_repeat():
    first, second = faulty_service(raise_rate=0.5), faulty_service(raise_rate=0.5)

    async def calls(service):
        return [await service.call("calculator", {"expression": f"{n}+1"}) for n in range(30)]

    one, two = asyncio.run(calls(first)), asyncio.run(calls(second))
    assert [(r.status, r.attempts) for r in one] == [(r.status, r.attempts) for r in two]
    assert any(r.ok and r.attempts == 2 for r in one)  # failed once, then succeeded on the retry
    assert any(not r.ok for r in one)


def test_faulty_tool_options_are_checked():
    with pytest.raises(ValueError, match="add up to 1.2; they must add up to at most 1"):
        build_tools([{"name": "faulty", "options": {"tool": "calculator", "raise_rate": 0.6, "hang_rate": 0.6}}])
    with pytest.raises(ValueError, match="hang_rate must be in"):
        build_tools([{"name": "faulty", "options": {"tool": "calculator", "hang_rate": -0.1}}])


def capture_runtime(monkeypatch, prepare=None) -> list:
    """The runtimes ``train_lm`` builds, as it builds them; ``prepare(runtime)`` runs on each before it starts."""
    built, original = [], text.build_runtime

    def recording(*args, **kwargs):
        built.append(original(*args, **kwargs))
        if prepare is not None:
            prepare(built[-1])
        return built[-1]

    monkeypatch.setattr(text, "build_runtime", recording)
    return built


def nan_gradient_at(backward_call: int, monkeypatch) -> None:
    """Make the gradient of the policy's first parameter NaN in the ``backward_call``-th backward pass."""
    original, calls = text.policy_from_config, []

    def poisoned(config, *roles):
        policy = original(config, *roles)

        def hook(gradient):
            calls.append(1)
            return gradient * float("nan") if len(calls) == backward_call else gradient

        next(policy.model.parameters()).register_hook(hook)
        return policy

    monkeypatch.setattr(text, "policy_from_config", poisoned)


FORCED_FAULT = contextvars.ContextVar("forced_fault", default=None)


def calls_fail_until_one_has_timed_out(service, monkeypatch) -> None:
    """Until a call of ``service`` has ended with the default observation after a timeout, every call of its
    ``faulty`` calculator raises on its first attempt and hangs on its retry; after that, calls meet the faults
    drawn for them. Which expressions the policy writes depends on timing, so the drawn faults alone may miss
    these. A forced call that an interrupt cancels does not count: forcing goes on."""
    tool, draw, call, done = service.tools["calculator"], faulty.draw_fault, service.call, threading.Event()
    drawn, schedule = tool.function, {1: "raise", 2: "hang"}  # attempt -> fault

    async def scheduled(**arguments):
        token = FORCED_FAULT.set(None if done.is_set() else schedule.get(current_attempt()))
        try:  # the forced fault goes through the faulty tool's own paths (and its ``injected`` count)
            return await drawn(**arguments)
        finally:
            FORCED_FAULT.reset(token)

    async def recording(name, arguments):
        result = await call(name, arguments)
        if result.status == "failed" and result.timeouts:
            done.set()
        return result

    monkeypatch.setattr(faulty, "draw_fault", lambda rates, rng: FORCED_FAULT.get() or draw(rates, rng))
    tool.function, service.call = scheduled, recording


def interrupt_at_episode_starts(rollout, starts: set[int], interrupted: list[int]) -> None:
    """When ``rollout`` starts its episode number ``starts`` (counting from 1), cancel one running group with
    ``LMRollout.interrupt`` from another thread, as a crash of its task would, and append what it returned to
    ``interrupted``. The starting episode waits for it, so at least its own group is running then."""
    make_loop, started = rollout.runner.agent_loop, []

    def interrupt_one():
        interrupted.append(rollout.interrupt(1))

    def agent_loop(engine):
        loop = make_loop(engine)
        run_episode = loop.run_episode

        async def interrupting(env, example, order):
            started.append(order)
            if len(started) in starts:
                await asyncio.to_thread(interrupt_one)  # may cancel this very group: it is then run again
            return await run_episode(env, example, order)

        loop.run_episode = interrupting
        return loop

    rollout.runner.agent_loop = agent_loop


@pytest.mark.e2e
def test_concurrent_agent_run_survives_tool_faults_interrupted_episodes_and_a_nan_gradient(
    embedded_path, tmp_path, monkeypatch
):
    config = load_config(
        None,
        AGENT
        + [
            f"log.output_dir={tmp_path}",
            "runtime.max_staleness=1",
            "runtime.schedule=concurrent",
            "train.updates=5",
            "checkpoint.every_updates=1",
            "rollback.enabled=true",
        ],
    )
    interrupted = []

    def chaos(runtime):  # on the rollout's own runner and service; the learner's evaluation is left alone
        calls_fail_until_one_has_timed_out(runtime.rollout.runner.service, monkeypatch)
        # the run needs 40 finished episodes, so it is still going when episode 21 starts
        interrupt_at_episode_starts(runtime.rollout, {5, 13, 21}, interrupted)

    runtimes = capture_runtime(monkeypatch, chaos)
    nan_gradient_at(3, monkeypatch)
    result = train_lm(config)
    assert sum(interrupted) >= 1
    records = [r for r in read_metrics(result.run_dir) if "train/loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]  # no gap, no repeat
    last = records[-1]
    parts = ("finished", "failed", "requeued", "cancelled", "in_flight")
    assert last["rollout/episodes_started"] == sum(last[f"rollout/episodes_{part}"] for part in parts)
    assert last["rollout/episodes_failed"] == 0 and last["rollout/episodes_requeued"] >= 4
    assert min(r["rollout/tool_calls"] for r in records) >= 0.5
    assert sum(r["rollout/tool_failures"] for r in records) > 0  # every attempt failed: the default observation
    assert sum(r["rollout/tool_timeouts"] for r in records) > 0  # hangs were cut at the timeout
    injected = runtimes[0].rollout.runner.service.tools["calculator"].injected
    assert {"raise", "hang"} <= set(injected) <= set(FAULT_KINDS)
    assert max(r["timing/learner_wait"] for r in records[1:]) < 60
    events = [json.loads(line) for line in (result.run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events].count("skipped_update") == 1  # the NaN step was dropped, once
    final = load_checkpoint(CheckpointStore(result.run_dir / "checkpoints").latest())
    assert final.step == 5
    assert all(torch.isfinite(tensor).all() for tensor in final.tensors["policy"].values())


KILLED_RUN = """
import sys
from unipg.config import load_config
from unipg.runtime.lm import train_lm
train_lm(load_config(None, sys.argv[1:]))
"""


@pytest.mark.e2e
def test_a_sigkilled_run_resumes_to_the_same_weights_as_an_uninterrupted_one(embedded_path, tmp_path):
    overrides = AGENT + [
        f"log.output_dir={tmp_path}",
        "deterministic=true",
        "train.updates=4",
        "checkpoint.every_updates=1",
        "checkpoint.keep_last=2",
    ]
    full = train_lm(load_config(None, overrides + ["log.run_name=full"]))
    killed = subprocess.Popen(
        [sys.executable, "-c", KILLED_RUN, *overrides, "log.run_name=killed"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    run_dir = tmp_path / "killed"
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoints" / "step-00000002").is_dir() and killed.poll() is None:
        assert time.monotonic() < deadline, "the run made no checkpoint of update 2 in 120 s"
        time.sleep(0.05)
    os.kill(killed.pid, signal.SIGKILL)
    assert killed.wait() == -signal.SIGKILL, killed.stderr.read().decode()[-2000:]
    resumed = train_lm(load_config(None, overrides + ["log.run_name=killed"]), resume=run_dir)
    assert resumed.resumed_from >= 2
    full_tensors = load_checkpoint(CheckpointStore(full.run_dir / "checkpoints").latest()).tensors
    resumed_tensors = load_checkpoint(CheckpointStore(run_dir / "checkpoints").latest()).tensors
    for name, tensor in full_tensors["policy"].items():
        assert torch.equal(tensor, resumed_tensors["policy"][name]), name
    steps = [r["step"] for r in read_metrics(run_dir)]
    assert steps == [0, 1, 2, 3, 4]


@pytest.mark.e2e
def test_a_short_soak_opens_no_descriptors_and_starts_no_threads_per_update(tmp_path):
    """The long version (benchmarks/soak.py) runs 256 episodes at once for 15 minutes and reports memory too."""
    config = load_config(
        None,
        AGENT
        + [
            f"log.output_dir={tmp_path}",
            "runtime.max_staleness=2",
            "runtime.schedule=concurrent",
            "agent.concurrency=32",
            "train.updates=8",
            "checkpoint.every_updates=2",
            "checkpoint.keep_last=2",
        ],
    )
    records = [r for r in read_metrics(train_lm(config).run_dir) if "train/loss" in r]
    assert [r["step"] for r in records] == list(range(1, 9))
    files = [r["system/open_files"] for r in records[2:]]
    threads = [r["system/threads"] for r in records[2:]]
    assert max(files) == min(files), files  # checkpoints, logs and tool calls close what they open
    assert max(threads) - min(threads) <= 4, threads  # thread pools are bounded; nothing starts a thread per update
    assert all(r["system/rss_mb"] > 0 for r in records)


ARENA_PROBE = """
import ctypes, subprocess, sys, threading
from unipg.observe.metrics import limit_malloc_arenas
capped = limit_malloc_arenas() if sys.argv[1] == "cap" else None
child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('MALLOC_ARENA_MAX'))"],
                       capture_output=True, text=True).stdout.strip()
print(capped, child, flush=True)
together = threading.Barrier(13)
def allocate():  # each thread's first allocation takes an arena of its own while there may be more
    blocks = [bytearray(100_000) for _ in range(4)]
    together.wait()
    together.wait()
threads = [threading.Thread(target=allocate) for _ in range(12)]
for thread in threads:
    thread.start()
together.wait()
ctypes.CDLL("libc.so.6").malloc_stats()  # one "Arena N:" paragraph per arena, on standard error
together.wait()
"""


def arenas_in_use(*arguments: str, **environment: str) -> tuple[str, int]:
    """What the probe's ``limit_malloc_arenas`` call returned and the cap a child process of it sees, and the
    malloc arenas of the probe's 12 threads."""
    base = {key: value for key, value in os.environ.items() if key not in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES")}
    probe = subprocess.run(
        [sys.executable, "-c", ARENA_PROBE, *arguments],
        env={**base, **environment},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode == 0, probe.stderr
    return probe.stdout.strip(), sum(line.startswith("Arena ") for line in probe.stderr.splitlines())


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc arenas")
def test_malloc_arenas_are_capped_in_unipg_and_its_children_unless_already_capped():
    default, arenas = arenas_in_use("default")
    assert default == "None None" and arenas > 2  # glibc's default: an arena per thread, up to eight per core
    assert arenas_in_use("cap") == ("True 2", 2)  # and the processes it starts inherit the cap
    assert arenas_in_use("cap", MALLOC_ARENA_MAX="4") == ("False 4", 4)  # the user's own cap is kept
