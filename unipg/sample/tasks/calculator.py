"""Agent tasks that need a tool: multi-digit arithmetic with a calculator.

``calculator``: "What is 347*862?" with operands of ``digits`` digits. A small model cannot multiply such
numbers in its head, so the reliable way to the answer is one calculator call followed by the result::

    assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "347*862"}}</tool_call>
    tool:      299114
    assistant: 299114

A fraction ``1 − tool_demonstrations`` of the demonstrations answer directly, without the tool, as a
model that guesses would; supervised warm-starting on this mix gives a policy that mostly guesses, and RL
has to discover that calling the calculator pays.
"""

from __future__ import annotations

import random

from unipg.sample.tasks.base import (
    TASKS,
    Example,
    Task,
    _check_sizes,
    _sample_excluding,
    split_sizes,
)
from unipg.sample.tools.base import format_tool_call


@TASKS.register("calculator")
def calculator_task(digits: int = 3, operations: str = "*", num_train: int | None = None, num_test: int = 200,
                    tool_demonstrations: float = 0.3, data_seed: int = 1234) -> Task:
    """"What is a<op>b?" with ``digits``-digit operands; solved with the ``calculator`` tool in two turns.

    ``tool_demonstrations`` is the fraction of training demonstrations that call the tool (chosen per
    example, deterministically from ``data_seed``); the others answer at once. ``num_train`` None means
    5000. Train and test never share a problem.
    """
    if not isinstance(digits, int) or not 1 <= digits <= 6:
        raise ValueError(f"calculator: digits must be an integer in 1..6, got {digits!r}")
    if not operations or set(operations) - set("+-*") or len(set(operations)) != len(operations):
        raise ValueError(f"calculator: operations must be distinct characters from '+-*', got {operations!r}")
    if not 0.0 <= tool_demonstrations <= 1.0:
        raise ValueError(f"calculator: tool_demonstrations must be a fraction in [0, 1], got {tool_demonstrations}")
    _check_sizes("calculator", num_train=num_train, num_test=num_test)
    low, high = 10 ** (digits - 1) if digits > 1 else 0, 10**digits
    span = high - low
    space = len(operations) * span**2
    num_train = split_sizes(f"calculator: digits={digits} with operations={operations!r}", space,
                            num_train=num_train, num_test=num_test, default_train=5000)
    rng = random.Random(data_seed)
    test_ids = rng.sample(range(space), num_test)
    train_ids = _sample_excluding(rng, space, num_train, set(test_ids))
    uses_tool = random.Random(data_seed + 1)

    def example(problem_id: int, with_tool: bool) -> Example:
        operation_index, pair = divmod(problem_id, span**2)
        left, right = (low + value for value in divmod(pair, span))
        operation = operations[operation_index]
        expression = f"{left}{operation}{right}"
        result = str({"+": left + right, "-": left - right, "*": left * right}[operation])
        if with_tool:
            solution = [{"role": "assistant", "content": format_tool_call("calculator", {"expression": expression})},
                        {"role": "tool", "content": result}, {"role": "assistant", "content": result}]
        else:
            solution = [{"role": "assistant", "content": result}]
        return Example(f"What is {expression}?", result, solution, {"answer": result})

    return Task(
        name="calculator",
        train=[example(i, uses_tool.random() < tool_demonstrations) for i in train_ids],
        test=[example(i, True) for i in test_ids],
        system_prompt=None,
        rewards=[{"name": "math", "weight": 1.0}],
        tools=[{"name": "calculator"}],
        max_turns=3,
    )
