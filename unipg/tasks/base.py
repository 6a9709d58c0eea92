"""Single-turn text tasks: a question, a reference answer and a demonstration, split into train, validation and
test.

A task is built by name from the ``TASKS`` registry with ``make_task(name, **options)``. Every example
carries ``columns`` (at least ``{"answer": answer}``) that are handed to reward functions as keyword
arguments, the way TRL hands dataset columns to ``GRPOTrainer`` reward functions.

- ``arithmetic``: bare expressions such as ``"37+48="`` whose completion is just the number; short enough
  for a character-level policy trained from scratch.
- ``gsm8k`` (module ``gsm8k``): grade-school word problems in the GSM8K format, generated or read from files.
- ``dataset`` (module ``dataset``): any table of prompts and answers loaded with Hugging Face ``datasets``.

Train and test never share a prompt, and every split is a deterministic function of ``data_seed``.

The three splits have three uses. Train is what the policy learns from. Validation is what every decision
taken during training reads: the warm start's evidence stop and the choice of the best checkpoint. Test is read
only to report: a run's ``eval/…`` metrics and ``unipg eval``. A task may bring its own validation split; one
that does not (``Task.validation`` None, as a plugin's task usually is) gets one carved out of its train split by
``make_task`` (``with_validation``), so no task trains on the examples that judge it.
"""

from __future__ import annotations

import inspect
import random
from dataclasses import dataclass, field, replace
from typing import Callable

from unipg.registry import FactoryRegistry, check_option_types, validate_options


@dataclass(frozen=True)
class Example:
    """One prompt of a task."""

    prompt: str | list[dict]  # the user message (question text) without chat formatting, or a conversation
    # ({"role", "content"} messages) the policy answers
    answer: str  # the reference final answer as a canonical string, e.g. "85" or "-12"
    solution: str | list[dict]  # a demonstration, used for SFT: the completion text, or for agent tasks the
    # turns after the prompt as chat messages ({"role": "assistant" | "tool", "content": ...})
    columns: dict = field(default_factory=dict)  # extra per-example columns handed to reward functions


@dataclass
class Task:
    """A named set of train, validation and test examples with the rewards that grade them by default."""

    name: str
    train: list[Example]
    test: list[Example]
    system_prompt: str | None  # optional system message placed before every prompt
    rewards: list[dict]  # default reward spec for ``rewards.build_rewards``, e.g. [{"name": "math"}]
    tools: list[dict] = field(default_factory=list)  # tools an agent may call, e.g. [{"name": "calculator"}]
    max_turns: int = 1  # policy turns per episode; 1 = single-turn (the completion is the answer)
    process_weight: float = 0.1  # the agent's process reward when agent.process_weight is unset (see AgentConfig)
    # Multi-role tasks (``unipg.sample.roles``); a one-role task leaves these empty.
    roles: dict[str, str | None] = field(default_factory=dict)  # role → its system prompt, in trajectory order
    env: str | None = None  # the environment (an ``ENVS`` name); None: ``tool`` with tools, else ``single_turn``
    env_options: dict = field(default_factory=dict)  # options of ``env``
    role_demonstrations: Callable | None = None  # example → [(role, first observation, solution)] for SFT
    # Examples that training-time decisions read (module docstring), disjoint from train and test; None: the task
    # brings none, and ``make_task`` carves one out of train (``with_validation``).
    validation: list[Example] | None = None


def direct_answer(answer: str) -> list[dict]:
    """A demonstration that answers without a tool, in a sentence as a chat model would: "The answer is 42."

    Agent tasks (calculator, units) mix these with demonstrations that call a tool. Both kinds then start with
    one likely token each (``T`` or ``<tool_call>``), so the warm start's mixture decides greedy decoding: with
    most demonstrations answering directly, greedy and sampled episodes both mostly guess before RL. (A bare
    number would spread the direct answers over hundreds of leading digit groups, and greedy decoding would call
    the tool even when nine demonstrations in ten guess.) The final answer is the sentence's last number.
    """
    return [{"role": "assistant", "content": f"The answer is {answer}."}]


def role_task(task: Task, role: str, system_prompt: str | None) -> Task:
    """One role's side of a multi-role task as a one-role task: every demonstration of ``role``
    (``task.role_demonstrations``) becomes an example of its own, the role's first observation its prompt. A model
    that plays only that role (``agent.role_policy: separate``) is warm-started on it, and the evidence of its
    warm start is measured on it, as for any one-role task; it has no test split (reports read the team's)."""

    def own(examples: list[Example]) -> list[Example]:
        return [
            Example(observation, example.answer, solution, example.columns)
            for example in examples
            for shown_role, observation, solution in task.role_demonstrations(example)
            if shown_role == role
        ]

    if role not in task.roles:
        raise ValueError(f"task '{task.name}' has no role '{role}' (its roles: {', '.join(task.roles) or 'none'})")
    return replace(
        task,
        name=f"{task.name} ({role})",
        train=own(task.train),
        validation=own(task.validation) if task.validation is not None else None,
        test=[],
        system_prompt=system_prompt,
        roles={},
        env=None,
        env_options={},
        role_demonstrations=None,
    )


TASKS = FactoryRegistry("task")  # a factory's keyword parameters are the task's options

VALIDATION_EXAMPLES = 128
"""The most validation examples a task keeps when no size is asked for: the split is evaluated at every evaluation
during training, so it is kept small."""


def make_task(name: str, *, validation_examples: int | None = None, **options) -> Task:
    """Build the task registered as ``name``, with a validation split (``with_validation``: ``validation_examples``
    of them, carved with the task's ``data_seed`` when the task brings none); unknown option names raise a
    ValueError listing the valid ones."""
    factory = TASKS.get(name)
    validate_options(TASKS, name, options)
    check_option_types("task", name, factory, options)
    return with_validation(factory(**options), size=validation_examples, seed=_data_seed(factory, options))


def _data_seed(factory: Callable, options: dict) -> int:
    """The ``data_seed`` a task is built with (its option, else the factory's default); 0 for a task without one."""
    if "data_seed" in options:
        return options["data_seed"]
    parameter = inspect.signature(factory).parameters.get("data_seed")
    default = parameter.default if parameter is not None else 0
    return default if isinstance(default, int) else 0


def validation_size(train_count: int, size: int | None) -> int:
    """How many of ``train_count`` training examples a task without a validation split of its own gives up to one:
    ``size`` when given, else a tenth of them, at most ``VALIDATION_EXAMPLES`` and at least 1 when there are two or
    more (so that one is left to train on)."""
    if size is not None:
        return size
    return min(VALIDATION_EXAMPLES, max(1, train_count // 10)) if train_count >= 2 else 0


def with_validation(task: Task, *, size: int | None = None, seed: int = 0) -> Task:
    """``task`` with a validation split. A task that brings one keeps its first ``size`` examples (None:
    ``VALIDATION_EXAMPLES``); any other gives up ``validation_size`` training examples to one, chosen with
    ``seed``. Train keeps the order of the examples it keeps and test is not read, so the carve changes neither
    which examples are in test nor anything of train but the carved examples' absence; it draws only indices, so
    it costs one copy of the train list."""
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
        raise ValueError(f"task '{task.name}': validation_examples must be a non-negative integer, got {size!r}")
    if task.validation is not None:
        own = task.validation[: VALIDATION_EXAMPLES if size is None else size]
        return task if len(own) == len(task.validation) else replace(task, validation=own)
    count = validation_size(len(task.train), size)
    if count and count >= len(task.train):
        raise ValueError(
            f"task '{task.name}': validation_examples ({count}) would take every one of its {len(task.train)} "
            "training examples; ask for fewer (eval.validation_examples), or for 0 to carve no validation split"
        )
    chosen = set(random.Random(f"validation-{seed}").sample(range(len(task.train)), count))
    train = [example for index, example in enumerate(task.train) if index not in chosen]
    return replace(task, train=train, validation=[task.train[index] for index in sorted(chosen)])


# ---------------------------------------------------------------------------------------------------------
# arithmetic


@TASKS.register("arithmetic")
def arithmetic_task(
    digits: int = 2,
    operations: str = "+-",
    num_train: int | None = None,
    num_test: int = 200,
    data_seed: int = 1234,
) -> Task:
    """Expressions ``"a<op>b="`` with operands uniform on 0..10**digits − 1; the completion is the exact result.

    The problem space holds len(operations) · (10**digits)² distinct problems; the test set is drawn first,
    so it does not change when ``num_train`` does, and the train set is drawn from the remaining problems.
    ``num_train`` None means 20000, or every remaining problem when fewer are left (19800 for the default
    two digits and "+-"); an explicit size the space cannot hold is an error.
    """
    check_operation_task("arithmetic", digits, operations)
    operand_count = 10**digits
    train_ids, test_ids = operation_problem_split(
        "arithmetic",
        digits,
        operations,
        operand_count,
        num_train=num_train,
        num_test=num_test,
        data_seed=data_seed,
        default_train=20000,
    )

    def example(problem_id: int) -> Example:
        operation_index, operand_pair = divmod(problem_id, operand_count**2)
        left, right = divmod(operand_pair, operand_count)
        operation = operations[operation_index]
        result = {"+": left + right, "-": left - right, "*": left * right}[operation]
        return Example(f"{left}{operation}{right}=", str(result), str(result), {"answer": str(result)})

    return Task(
        name="arithmetic",
        train=[example(i) for i in train_ids],
        test=[example(i) for i in test_ids],
        system_prompt=None,
        rewards=[{"name": "math", "weight": 1.0}],
    )


def check_operation_task(task: str, digits: int, operations: str) -> None:
    """``digits`` an integer in 1..6, ``operations`` distinct characters from '+-*'."""
    if not isinstance(digits, int) or not 1 <= digits <= 6:
        raise ValueError(f"{task}: digits must be an integer in 1..6, got {digits!r}")
    if not operations or set(operations) - set("+-*") or len(set(operations)) != len(operations):
        raise ValueError(f"{task}: operations must be distinct characters from '+-*', got {operations!r}")


def operation_problem_split(
    task: str,
    digits: int,
    operations: str,
    operand_count: int,
    *,
    num_train: int | None,
    num_test: int,
    data_seed: int,
    default_train: int,
) -> tuple[list[int], list[int]]:
    """(train ids, test ids) of distinct problems ``left op right``, each operand one of ``operand_count``
    values, id = operation index · operand_count² + left · operand_count + right; the test split is drawn first
    and the train split never repeats it (``check_operation_task`` first)."""
    _check_sizes(task, num_train=num_train, num_test=num_test)
    space = len(operations) * operand_count**2
    num_train = split_sizes(
        f"{task}: digits={digits} with operations={operations!r}",
        space,
        num_train=num_train,
        num_test=num_test,
        default_train=default_train,
    )
    rng = random.Random(data_seed)
    test_ids = rng.sample(range(space), num_test)
    return _sample_excluding(rng, space, num_train, set(test_ids)), test_ids


def _check_sizes(task: str, **sizes: int | None) -> None:
    for option, value in sizes.items():
        if value is not None and (not isinstance(value, int) or value < 0):
            raise ValueError(f"{task}: {option} must be a non-negative integer, got {value!r}")


def split_sizes(
    what: str,
    space: int,
    *,
    num_train: int | None,
    num_test: int,
    default_train: int,
    fix: str = "lower num_test / num_train or raise digits",
) -> int:
    """The train size of a task with ``space`` distinct problems (``num_train`` None: ``default_train`` or all
    that the test set leaves); a ValueError naming ``what`` limits the space when the sizes do not fit in it."""
    if num_test > space:
        raise ValueError(f"{what} gives only {space} distinct problems, fewer than num_test = {num_test}; {fix}")
    if num_train is None:
        num_train = min(default_train, space - num_test)
        if num_train == 0:
            raise ValueError(
                f"{what} gives only {space} distinct problems and num_test = {num_test} takes them "
                f"all, leaving none to train on; {fix}"
            )
    if num_train + num_test > space:
        raise ValueError(
            f"{what} gives only {space} distinct problems, fewer than num_train + num_test = "
            f"{num_train + num_test}; {fix}"
        )
    return num_train


def _sample_excluding(rng: random.Random, space: int, count: int, excluded: set[int]) -> list[int]:
    """``count`` distinct ids from range(space) outside ``excluded``, without materialising a large space."""
    if count + len(excluded) > space:
        raise ValueError(f"cannot draw {count} problems from {space - len(excluded)} left; ask for fewer")
    if count + len(excluded) > space // 2:  # dense: rejection sampling would mostly hit taken ids
        remaining = [i for i in range(space) if i not in excluded]
        return rng.sample(remaining, count)
    chosen: list[int] = []
    taken = set(excluded)
    while len(chosen) < count:
        candidate = rng.randrange(space)
        if candidate not in taken:
            taken.add(candidate)
            chosen.append(candidate)
    return chosen
