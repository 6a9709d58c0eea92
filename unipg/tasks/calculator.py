"""Agent tasks that need a tool: multi-digit arithmetic with a calculator.

``calculator``: "What is 347*862?" with operands of ``digits`` digits. A small model cannot multiply such
numbers in its head, so the reliable way to the answer is one calculator call followed by the result::

    assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "347*862"}}</tool_call>
    tool:      299114
    assistant: 299114

A fraction ``1 − tool_demonstrations`` of the demonstrations answer directly, without the tool, in a
sentence (``The answer is 299114.``: ``unipg.tasks.base.direct_answer``), as a model that guesses would;
supervised warm-starting on this mix gives a policy that mostly guesses, greedily and sampled, and RL has to
discover that calling the calculator pays.
"""

from __future__ import annotations

import random

from unipg.tasks.base import (
    TASKS,
    Example,
    Task,
    check_operation_task,
    direct_answer,
    operation_problem_split,
)
from unipg.tools.base import format_tool_call


@TASKS.register("calculator")
def calculator_task(
    digits: int = 3,
    operations: str = "*",
    num_train: int | None = None,
    num_test: int = 200,
    tool_demonstrations: float = 0.3,
    data_seed: int = 1234,
) -> Task:
    """ "What is a<op>b?" with ``digits``-digit operands; solved with the ``calculator`` tool in two turns.

    ``tool_demonstrations`` is the fraction of training demonstrations that call the tool (chosen per
    example, deterministically from ``data_seed``); the others answer at once. ``num_train`` None means
    5000. Train and test never share a problem.
    """
    check_operation_task("calculator", digits, operations)
    if not 0.0 <= tool_demonstrations <= 1.0:
        raise ValueError(f"calculator: tool_demonstrations must be a fraction in [0, 1], got {tool_demonstrations}")
    low, high = 10 ** (digits - 1) if digits > 1 else 0, 10**digits
    span = high - low
    train_ids, test_ids = operation_problem_split(
        "calculator",
        digits,
        operations,
        span,
        num_train=num_train,
        num_test=num_test,
        data_seed=data_seed,
        default_train=5000,
    )
    uses_tool = random.Random(data_seed + 1)

    def example(problem_id: int, with_tool: bool) -> Example:
        operation_index, pair = divmod(problem_id, span**2)
        left, right = (low + value for value in divmod(pair, span))
        operation = operations[operation_index]
        expression = f"{left}{operation}{right}"
        result = str({"+": left + right, "-": left - right, "*": left * right}[operation])
        if with_tool:
            solution = [
                {"role": "assistant", "content": format_tool_call("calculator", {"expression": expression})},
                {"role": "tool", "content": result},
                {"role": "assistant", "content": result},
            ]
        else:
            solution = direct_answer(result)
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
