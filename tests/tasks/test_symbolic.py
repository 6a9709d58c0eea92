"""Symbolic answer comparison is bounded: answers slow for sympy are cut at the per-answer and per-call limits of the
``math`` reward and score 0.0, and a reward call given up on leaves no process computing behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from unipg.tasks.rewards.rules import REWARDS

ROOT = Path(__file__).resolve().parents[2]
GUARD_SECONDS = 300  # only a failure guard for the child interpreter: the limits under test are seconds

# Each passes symbolic_refusal yet holds sympy for seconds to minutes (math_verify's own 5 s limit applies only
# where it runs on the main thread).
SLOW = [
    "#### \\Gamma(10^{9})",
    "#### \\binom{10^{9}}{10^{8}}",
    "#### \\frac{\\Gamma(10^{9})}{2}",
    "#### \\Gamma(10^{8}) + 1",
]

SCORE = r"""
import json, sys
from unipg.tasks.rewards.rules import REWARDS
from unipg.tasks.rewards.symbolic import symbolic_pool
options, completions = json.loads(sys.argv[1]), json.loads(sys.argv[2])
scores = REWARDS.get("math")(**options)([""] * len(completions), completions, answer=["7"] * len(completions))
print(json.dumps({"scores": scores, "undecided": symbolic_pool().undecided}))
"""


def score_in_child(options: dict, completions: list) -> dict:
    """The math reward's scores and the pool's undecided count, from a fresh interpreter (a regression there
    fails the test at the guard instead of freezing the test run)."""
    child = subprocess.run(
        [sys.executable, "-c", SCORE, json.dumps(options), json.dumps(completions)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=GUARD_SECONDS,
    )
    assert child.returncode == 0, child.stderr
    return json.loads(child.stdout)


def test_a_batch_of_slow_answers_ends_at_the_calls_limit_and_scores_them_wrong():
    # the per-answer limit is out of reach: only the call's limit can end it
    result = score_in_child({"timeout": 3600, "batch_timeout": 1}, [*SLOW, "#### 7", "#### 8"])
    assert result == {"scores": [0.0, 0.0, 0.0, 0.0, 1.0, 0.0], "undecided": 4}


def test_each_slow_answer_is_cut_at_its_own_limit():
    result = score_in_child({"timeout": 0.5, "batch_timeout": 3600}, SLOW)
    assert result == {"scores": [0.0] * 4, "undecided": 4}


ABANDON = r"""
import json, threading
import psutil
from unipg.tasks.rewards.rules import REWARDS
completions = json.loads(__import__("sys").argv[1])
reward = REWARDS.get("math")(timeout=3600, batch_timeout=3600)
call = threading.Thread(target=reward, args=([""] * len(completions), completions), kwargs={"answer": ["7"] * 4},
                        daemon=True)
call.start()
call.join(10)  # give up on it; the children it started are computing (or still starting)
print(json.dumps([child.pid for child in psutil.Process().children(recursive=True)]), flush=True)
"""


def test_a_reward_call_given_up_on_does_not_keep_the_process_or_its_children_alive():
    psutil = pytest.importorskip("psutil")
    child = subprocess.run(
        [sys.executable, "-c", ABANDON, json.dumps(SLOW)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=GUARD_SECONDS,
    )
    assert child.returncode == 0, child.stderr  # it exited, not waiting an hour for the comparisons
    started = []
    for pid in json.loads(child.stdout):
        try:
            started.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(started, timeout=GUARD_SECONDS)
    assert alive == []  # killed when the process exited, not left computing


EPISODE = r"""
import asyncio, json, sys
from unipg.tasks.rewards.rules import CombinedReward, REWARDS
completions = json.loads(sys.argv[1])
combined = CombinedReward([("math", REWARDS.get("math")(timeout=3600, batch_timeout=3600), 1.0)])

async def episode():
    scoring = asyncio.ensure_future(combined.acall([""] * 4, completions, answer=["7"] * 4))
    for _ in range(3):
        await asyncio.sleep(0)  # the reward's task runs in between: were it to block, this would not return
    print("the loop turned while the answers were compared", flush=True)
    scoring.cancel()  # the episode is given up
    await asyncio.gather(scoring, return_exceptions=True)

asyncio.run(episode())
print("given up", flush=True)
"""


def test_a_reward_awaited_on_an_event_loop_leaves_the_loop_running_and_can_be_given_up():
    child = subprocess.run(
        [sys.executable, "-c", EPISODE, json.dumps(SLOW)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=GUARD_SECONDS,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout == "the loop turned while the answers were compared\ngiven up\n"


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="batch_timeout"):
        REWARDS.get("math")(batch_timeout=0)
