"""An agent task with a typed, several-argument tool: unit conversion with ``convert(value, from_unit, to_unit)``.

``units``: "How many m are in 347 km?", in one of several phrasings, from a larger unit to a smaller one of the
same kind (so the answer is a whole number). Solving it means calling the tool with the right number and the right
two unit words, then reporting its result::

    assistant: <tool_call>{"name": "convert", "arguments": {"value": 347, "from_unit": "km", "to_unit": "m"}}</tool_call>
    tool:      347000
    assistant: 347000

Unlike the calculator's one free-text argument, the call has three typed arguments, two of them words of a closed
vocabulary (``unipg.tools.units.UNITS``): a unit outside it is a malformed call, two units of different
kinds a tool error. As in ``calculator``, a fraction ``1 − tool_demonstrations`` of the training demonstrations
answer without the tool, in a sentence (``unipg.tasks.base.direct_answer``), and train and test never share a
problem (value, unit pair).
"""

from __future__ import annotations

import random

from unipg.tasks.base import TASKS, Example, Task, direct_answer, split_sizes
from unipg.tools.base import format_tool_call
from unipg.tools.units import UNITS

PHRASINGS = (
    "Convert {value} {source} to {target}.",
    "How many {target} are in {value} {source}?",
    "What is {value} {source} in {target}?",
    "{value} {source} = ? {target}",
)
"""The ways a question is asked; each problem gets one, drawn from ``data_seed`` and the problem."""


def conversion_pairs() -> list[tuple[str, str]]:
    """(from, to) unit pairs of one kind whose factor is a whole number greater than one: km→m, day→min, ft→in."""
    pairs = []
    for source, (kind, size) in UNITS.items():
        for target, (other, target_size) in UNITS.items():
            factor = size / target_size
            if kind == other and factor > 1 and factor.denominator == 1:
                pairs.append((source, target))
    return pairs


def _example(
    problem_id: int, with_tool: bool, *, pairs: list[tuple[str, str]], values: int, low: int, data_seed: int
) -> Example:
    """Problem ``problem_id`` (a unit pair of ``pairs`` and one of ``values`` whole numbers from ``low``) as an
    example: its phrasing drawn from ``data_seed`` and the problem, its demonstration calling the tool or not."""
    pair_index, offset = divmod(problem_id, values)
    (source, target), value = pairs[pair_index], low + offset
    answer = str(value * int(UNITS[source][1] / UNITS[target][1]))
    phrasing = random.Random(f"{data_seed}-{problem_id}").choice(PHRASINGS)  # the same in any split size
    prompt = phrasing.format(value=value, source=source, target=target)
    call = format_tool_call("convert", {"value": value, "from_unit": source, "to_unit": target})
    solution = (
        [
            {"role": "assistant", "content": call},
            {"role": "tool", "content": answer},
            {"role": "assistant", "content": answer},
        ]
        if with_tool
        else direct_answer(answer)
    )
    return Example(prompt, answer, solution, {"answer": answer})


def _check_options(digits: int, tool_demonstrations: float, process_reward: float) -> None:
    if not isinstance(digits, int) or not 1 <= digits <= 6:
        raise ValueError(f"units: digits must be an integer in 1..6, got {digits!r}")
    for name, value, high in (
        ("tool_demonstrations", tool_demonstrations, 1.0),
        ("process_reward", process_reward, 0.5),
    ):
        if not 0.0 <= value <= high:
            raise ValueError(f"units: {name} must be in [0, {high}], got {value}")


@TASKS.register("units")
def units_task(
    digits: int = 3,
    num_train: int | None = None,
    num_test: int = 200,
    tool_demonstrations: float = 0.3,
    process_reward: float = 0.1,
    data_seed: int = 1234,
) -> Task:
    """Convert a ``digits``-digit whole number of one unit to a smaller unit of the same kind, with ``convert``.

    ``tool_demonstrations``: the fraction of training demonstrations that call the tool (the others answer at
    once). ``process_reward``: the reward, relative to 1 for a correct answer, of a well-formed call the tool
    answers (paid once per episode; a malformed call costs as much; 0 turns process rewards off; 0.1–0.2 helps
    a weak policy find the call without outweighing the answer). ``num_train`` None means 5000.
    """
    _check_options(digits, tool_demonstrations, process_reward)
    pairs, low = conversion_pairs(), 10 ** (digits - 1) if digits > 1 else 1
    values = 10**digits - low
    space = len(pairs) * values
    num_train = split_sizes(
        f"units: digits={digits}",
        space,
        num_train=num_train,
        num_test=num_test,
        default_train=5000,
        fix="lower num_test / num_train or raise digits",
    )
    rng = random.Random(data_seed)
    test_ids = rng.sample(range(space), num_test)
    taken = set(test_ids)
    train_ids = rng.sample([i for i in range(space) if i not in taken], num_train)
    uses_tool = random.Random(data_seed + 1)

    def example(problem_id: int, with_tool: bool) -> Example:
        return _example(problem_id, with_tool, pairs=pairs, values=values, low=low, data_seed=data_seed)

    test = [example(i, True) for i in test_ids]
    return Task(
        name="units",
        train=[example(i, uses_tool.random() < tool_demonstrations) for i in train_ids],
        test=test,
        system_prompt=None,
        rewards=[{"name": "math", "weight": 1.0}],
        tools=[{"name": "convert"}],
        max_turns=3,
        process_weight=process_reward,
    )
