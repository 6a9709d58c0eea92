"""A stop request ends a run in bounded time: an update whose rollout does not end within the grace after a signal
is given up (``UpdateAbandoned``), and a run stuck anywhere else exits the process at ``exit_after``."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from unipg.runtime.stopping import StopRequest, UpdateAbandoned
from unipg.sample.event_loop import run_abandoning

GUARD_SECONDS = 60  # only a failure guard


def test_a_wait_for_rollout_that_never_ends_is_given_up_after_the_grace():
    with StopRequest(grace=0.05) as stop, pytest.raises(UpdateAbandoned) as abandoned:
        with stop.abandonable():
            os.kill(os.getpid(), signal.SIGTERM)
            threading.Event().wait()  # rollout that never ends
    assert stop.signal_number == signal.SIGTERM and stop.overdue.is_set()
    assert abandoned.value.signal_number == signal.SIGTERM  # the command exits with 128 + 15


def test_episodes_waiting_on_their_event_loop_are_given_up_and_the_loop_is_left():
    async def episodes_that_never_end() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.Event().wait()

    with StopRequest(grace=0.05) as stop, pytest.raises(UpdateAbandoned), stop.abandonable():
        run_abandoning(episodes_that_never_end(), grace=0.05)


def test_past_the_grace_the_next_wait_for_rollout_is_given_up_at_once():
    with StopRequest(grace=0.05) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        stop.overdue.wait()  # the grace passed while the run was busy elsewhere (learning, saving)
        with pytest.raises(UpdateAbandoned), stop.abandonable():
            pass


def test_a_stop_that_comes_to_an_end_in_time_leaves_no_timer_behind():
    handler = signal.getsignal(signal.SIGTERM)
    with StopRequest(grace=GUARD_SECONDS) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        timers = list(stop._timers)
    for timer in timers:  # cancelled when the block was left: they signal nothing, and the default handler is back
        timer.join()
    assert not stop.overdue.is_set() and signal.getsignal(signal.SIGTERM) == handler


STUCK = """
import os, signal, threading
from unipg.runtime.stopping import StopRequest
with StopRequest(grace=0.1, exit_after=0.3):
    os.kill(os.getpid(), signal.SIGTERM)
    threading.Event().wait()  # stuck where no update can be given up
"""


def test_a_run_stuck_outside_rollout_exits_at_exit_after_with_the_signals_status():
    root = Path(__file__).resolve().parents[2]
    child = subprocess.Popen(
        [sys.executable, "-c", STUCK], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _, errors = child.communicate(timeout=GUARD_SECONDS)
    finally:
        child.kill()
    assert child.returncode == 128 + signal.SIGTERM, errors
    assert "did not finish within 0.1 s" in errors and "did not stop within 0.3 s" in errors
