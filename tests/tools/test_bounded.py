"""Computations on policy text are bounded before they start: adversarial answers and calculator expressions
are refused at once, symbolic checks run in a child process that is killed past its time."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import pytest

from unipg.tasks.rewards.rules import REWARDS, answers_equivalent
from unipg.tools.bounded import IsolatedFunction, parse_number, symbolic_refusal

ROOT = Path(__file__).resolve().parents[2]
GUARD_SECONDS = 30  # only a failure guard: each case below takes milliseconds

# Run in a child interpreter, so that a regression fails the test instead of freezing the test run.
ADVERSARIAL = r"""
import json, sys, time
from unipg.tasks.rewards.rules import REWARDS
from unipg.tasks.answers import normalize_answer
from unipg.tools.base import ToolError
from unipg.tools.calculator import calculator
completions = ["#### 9^9^9^9", "#### 2**2**2**2**2**2", "#### 2^{3^{4^{5}}}", "#### 10^{10^{10}}",
               "#### 9^{999999999}", "#### 1e100000000", "#### 3/1e100000000", "#### 100000!", "#### (10^9)!",
               "#### " + "9" * 100000, "#### 1" + " " * 200000 + "x", "1" + " ." * 200000 + "x",
               "#### (1/3^{64})^{3^{64}}"]
scores = REWARDS.get("math")()([""] * len(completions), completions, answer=["7"] * len(completions))
formats = REWARDS.get("format")()([""], ["#### " + "1" * 200000 + "x"])
refused = []
for expression in ["9**9**9**9", "2**2**2**2**2**2", "((1/3**64)**64)**64", "(1/3**64)**(3**64)",
                   "((2**-64)**64)**64", "(0.5**64)**64", "9" * 199]:
    try:
        calculator(expression)
        refused.append(expression.startswith("999"))  # a plain literal is printed, not refused
    except ToolError:
        refused.append(True)
print(json.dumps({"scores": scores, "formats": formats, "refused": refused}))
"""


def test_adversarial_answers_and_expressions_are_refused_quickly():
    root = Path(__file__).resolve().parents[2]
    start = time.monotonic()
    child = subprocess.run(
        [sys.executable, "-c", ADVERSARIAL], cwd=root, capture_output=True, text=True, timeout=GUARD_SECONDS + 30
    )
    assert child.returncode == 0, child.stderr
    assert time.monotonic() - start < GUARD_SECONDS
    result = json.loads(child.stdout)
    assert result["scores"] == [0.0] * 13
    assert result["formats"] == [0.0]
    assert all(result["refused"])


def test_normal_answers_keep_their_scores():
    completions = ["#### \\frac{3}{4}", "#### 1.5e3", "#### 3/4", "#### \\sqrt{4}", "#### 1,000,000"]
    answers = ["0.75", "1500", "0.75", "2", "1000000"]
    assert REWARDS.get("math")()([""] * 5, completions, answer=answers) == [1.0] * 5
    assert not answers_equivalent("\\sqrt{5}", "2")


def test_parse_number_refuses_numbers_too_large_to_build():
    assert parse_number("1e3") == 1000.0 and parse_number("-3/4") == Fraction(-3, 4) and parse_number("12") == 12
    assert parse_number("1e100000000") is None and parse_number("9" * 1001) is None
    assert parse_number("x") is None


@pytest.mark.parametrize("text", ["9^9^9", "2^{3^4}", "2**2**2", "10^{1000}", "2^{1e9}", "1000!", "(n)!", "x" * 301])
def test_symbolic_refusal_names_towers_large_exponents_and_factorials(text):
    assert symbolic_refusal(text) is not None


@pytest.mark.parametrize("text", ["2^{10}", "x^2+1", "\\frac{\\pi}{4}", "2\\sqrt{3}", "5!", "(1+2)^{3}"])
def test_symbolic_refusal_lets_ordinary_answers_through(text):
    assert symbolic_refusal(text) is None


def test_an_isolated_computation_that_holds_its_interpreter_is_killed_on_time():
    factorial = IsolatedFunction("math:factorial", timeout=0.5)
    assert factorial(5) == 120  # starts the child
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        factorial(10**9)  # holds the child's interpreter lock for minutes
    assert time.monotonic() - start < GUARD_SECONDS and factorial.kills == 1
    assert factorial(6) == 720  # a fresh child
    factorial.close()


def test_an_isolated_functions_child_imports_its_preloads_before_it_is_ready(monkeypatch):
    monkeypatch.chdir(ROOT)  # the child finds the tests package from its working directory
    bare = IsolatedFunction("tests.helpers.processes:imported")
    preloaded = IsolatedFunction("tests.helpers.processes:imported", preload=("fractions", "wave"))
    assert not bare("wave")  # nothing the child runs imports it by itself
    assert preloaded("wave") and preloaded("fractions")  # so a call's limit is not spent on imports
    bare.close()
    preloaded.close()
