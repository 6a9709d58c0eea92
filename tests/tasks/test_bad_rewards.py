"""Reward functions that raise or return something unusable: a ``RewardFunctionError`` naming the function,
what it returned (or raised) and what to do instead."""

import asyncio
import time
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch

from unipg.tasks.rewards.rules import (
    CombinedReward,
    RewardFunctionError,
    build_rewards,
)


def returning(value):
    def judge(prompts, completions, **columns):
        return value

    return judge


def combined_result(value, samples: int = 2):
    return CombinedReward.from_callables([(returning(value), 1.0)])(["p"] * samples, ["c"] * samples)


def test_a_reward_that_raises_is_named_with_its_exception_kept_as_the_cause():
    original = ZeroDivisionError("division by zero\n  while scoring completion 3")

    def grader(prompts, completions, **columns):
        raise original

    with pytest.raises(RewardFunctionError) as raised:
        CombinedReward.from_callables([(grader, 1.0)])(["p"], ["c"])
    message = str(raised.value)
    assert message == (
        "reward function 'grader' failed: division by zero (ZeroDivisionError); fix the function, "
        "or leave it out of the rewards (its traceback is this error's cause)"
    )
    assert raised.value.__cause__ is original
    assert isinstance(raised.value, ValueError)  # the command line prints ValueErrors in one line


def test_an_async_reward_that_raises_is_named_and_the_others_are_cancelled():
    cancelled = []

    async def slow_judge(prompts, completions, **columns):
        try:
            await asyncio.sleep(30.0)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return [1.0 for _ in completions]

    async def offline_judge(prompts, completions, **columns):
        await asyncio.sleep(0)
        raise ConnectionError("judge offline")

    combined = CombinedReward.from_callables([(slow_judge, 1.0), (offline_judge, 1.0)])
    start = time.monotonic()
    with pytest.raises(RewardFunctionError, match=r"'offline_judge' failed: judge offline \(ConnectionError\); fix"):
        combined(["p"], ["c"])

    async def inside_a_loop():
        with pytest.raises(RewardFunctionError, match="'offline_judge' failed") as raised:
            await combined.acall(["p"], ["c"])
        assert cancelled == [True, True]  # already, not only when the loop closes
        return raised.value

    assert isinstance(asyncio.run(inside_a_loop()).__cause__, ConnectionError)
    assert time.monotonic() - start < 20.0  # the slow judge was not waited for


@pytest.mark.parametrize(
    "value, got",
    [
        ([1.0], "returned 1 values for 2 completions"),
        ([1.0, 0.0, 1.0], "returned 3 values for 2 completions"),
        (1.0, "returned a float for 2 completions"),
        (None, "returned a NoneType for 2 completions"),
        ((value for value in [1.0, 1.0]), "returned a generator for 2 completions"),
        ("10", "returned a str for 2 completions"),
        ({"a": 1.0, "b": 2.0}, "returned a dict for 2 completions"),
        (np.ones((2, 1)), r"returned a ndarray of shape \(2, 1\) for 2 completions"),
        (torch.ones(1, 2), r"returned a Tensor of shape \(1, 2\) for 2 completions"),
        (torch.tensor(1.0), r"returned a Tensor of shape \(\) for 2 completions"),
    ],
)
def test_output_that_is_not_one_value_per_completion_says_what_it_was(value, got):
    with pytest.raises(
        RewardFunctionError,
        match=f"reward function 'judge' {got}; it must return a list with one "
        r"float \(or None\) per completion",
    ):
        combined_result(value)


@pytest.mark.parametrize(
    "value, shown",
    [
        ([1.0, float("nan")], "float nan for completion 1"),
        ([float("inf"), 1.0], "float inf for completion 0"),
        ([0.0, -np.inf], "float -inf for completion 1"),
        (np.array([1.0, np.nan]), "float64 nan for completion 1"),
        (torch.tensor([np.inf, 0.0]), r"Tensor tensor\(inf\) for completion 0"),
        ([1.0, 10**400], "int 1000000000000000000000000000000000000000... for completion 1"),
    ],
)
def test_non_finite_rewards_are_refused_with_the_completion_and_the_fix(value, shown):
    with pytest.raises(
        RewardFunctionError,
        match=f"'judge' returned {shown}; rewards must be finite: return None "
        "where the reward does not apply, or clip the value",
    ):
        combined_result(value)


@pytest.mark.parametrize(
    "value, shown",
    [
        (["1.0", "0.0"], "str '1.0' for completion 0"),
        ([1.0, [1.0]], r"list \[1.0\] for completion 1"),
        ([np.array([1.0]), 0.0], r"ndarray \[1.\] for completion 0"),
        ([1.0, 1j], r"complex 1j for completion 1"),
        (np.array(["1", "2"]), "str_ 1 for completion 0"),
        ([{"score": 1.0}, 0.0], "dict {'score': 1.0} for completion 0"),
    ],
)
def test_values_that_are_not_real_numbers_are_refused_with_the_completion(value, shown):
    with pytest.raises(
        RewardFunctionError,
        match=f"'judge' returned {shown}; each value must be a real number, or None where the reward does not apply",
    ):
        combined_result(value)


@pytest.mark.parametrize(
    "value",
    [
        [1, 0.5],
        (1, 0.5),
        [True, 0.5],
        np.array([1.0, 0.5], dtype=np.float32),
        [np.int64(1), np.float64(0.5)],
        torch.tensor([1.0, 0.5], requires_grad=True),
        [torch.tensor(1), torch.tensor(0.5)],
        [Fraction(1), Decimal("0.5")],
        [np.bool_(True), 0.5],
        np.array([1, 0.5])[np.newaxis][0],
    ],
)
def test_numbers_of_any_real_type_and_one_dimensional_arrays_are_accepted(value):
    result = combined_result(value)
    assert result.total == [1.0, 0.5] and all(type(v) is float for v in result.per_function["judge"])


def test_none_for_every_completion_means_not_applicable():
    result = combined_result([None, None])
    assert result.total == [0.0, 0.0] and result.not_applicable == 2 and result.per_function["judge"] == [None, None]
    assert result.means() == {}


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), "1.0", None, True])
def test_a_weight_that_is_not_a_finite_number_is_refused_by_name(weight):
    with pytest.raises(ValueError, match=f"reward 'math': weight must be a number and finite, got {weight!r}"):
        build_rewards([{"name": "math", "weight": weight}])
