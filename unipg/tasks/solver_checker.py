"""``solver_checker``: calculator problems solved by a team of two roles (``unipg.envs.solver_checker``).

The solver answers "What is 347*862?" (with the calculator or by guessing); the checker sees the problem and
the proposal, may check it with the calculator, and replies ``ACCEPT`` or a critique such as
``REJECT: 299114``, which the solver must answer. Demonstrations exist for both roles::

    solver:  "What is 347*862?"                   → <tool_call>…</tool_call> / 299114 / 299114   (a share guess)
    checker: "What is 347*862? Proposed: 299114"  → <tool_call>…</tool_call> / 299114 / ACCEPT
    checker: "What is 347*862? Proposed: 299124"  → <tool_call>…</tool_call> / 299114 / REJECT: 299114
    solver:  "What is 347*862?"                   → 299124 / (user) REJECT: 299114 / 299114   (a share)

With ``agreement`` the checker replies with the result itself (``299114`` for ``ACCEPT`` and for the critique),
and its demonstration on a wrong proposal goes on to a second round, where the solver has either copied the
result or repeated its wrong proposal; the checker replies with the result in both. Without the repeated case a
warm-started checker learns that the second round's reply is the proposal, and echoes a repeated wrong one,
which the protocol then accepts.

The wrong proposal a critique answers is context, not a target: it is laid out but not trained (``weight: 0``),
so a demonstration never teaches a wrong answer, and the copy is the only thing a critique demonstration trains.

With ``solver_tool=False`` only the checker holds the calculator: the solver's demonstrations all answer at once
(a guess, in a sentence), and the environment runs no call the solver writes (its text is its proposal). The
solver alone then cannot get beyond guessing; in the team the checker's critique carries the calculator's result,
which the solver has to learn to copy, so the second role adds information the first one lacks.
"""

from __future__ import annotations

import random
import re

from unipg.tasks.answers import extract_final_answer
from unipg.tasks.base import TASKS, Example, Task, direct_answer
from unipg.tasks.calculator import calculator_task
from unipg.tools.base import format_tool_call

SOLVER, CHECKER = "solver", "checker"
ACCEPT = "ACCEPT"


def checker_observation(example: Example, proposal: str) -> str:
    """What the checker is asked: the problem and the answer the solver proposed.

    The proposal's final answer, not its words: the solver answers in a sentence when it guesses ("The answer is
    299114.") and with the bare result after a calculator call, while the checker's demonstrations show the bare
    number; a sentence would put the checker's input outside everything it was warm-started on.

    >>> checker_observation(Example("What is 12*34?", "408", ""), "The answer is 418.")
    'What is 12*34? Proposed: 418'
    """
    answer = extract_final_answer(proposal)
    return f"{example.prompt} Proposed: {proposal.strip() if answer is None else answer}"


ROLE_PROMPTS = {SOLVER: "solve", CHECKER: "check"}  # short: the embedded model reads one character per token


def wrong_answer(answer: str, rng: random.Random) -> str:
    """``answer`` with one digit changed: a plausible wrong proposal."""
    digits = [i for i, c in enumerate(answer) if c.isdigit()]
    index = rng.choice(digits)
    leading = index == digits[0] and len(digits) > 1  # a leading digit never becomes 0
    replacement = rng.choice([d for d in "0123456789" if d != answer[index] and not (leading and d == "0")])
    return answer[:index] + replacement + answer[index + 1 :]


def role_demonstrations(
    example: Example,
    *,
    critique_demonstrations: float,
    seed: int,
    critique_copies: float = 1.0,
    solver_tool: bool = True,
    answer_demonstrations: float = 1.0,
    agreement: bool = False,
) -> list[tuple]:
    """(role, first observation, solution) demonstrations of ``example`` for both roles (module docstring). In a
    share ``1 - critique_copies`` of the solver's critique demonstrations it repeats its proposal instead of copying
    the critique's result; a solver without the tool proposes in a sentence, as all its demonstrations answer. A
    share ``answer_demonstrations`` of examples has the solver's demonstration of answering at once. With
    ``agreement`` the checker's reply is the result itself, whatever the proposal, in each round it is asked."""
    rng = random.Random(f"{seed}:{example.prompt}")
    expression = re.fullmatch(r"What is (.*)\?", example.prompt).group(1)
    call = format_tool_call("calculator", {"expression": expression})
    wrong = wrong_answer(example.answer, rng)

    accept, critique = (example.answer, example.answer) if agreement else (ACCEPT, f"REJECT: {example.answer}")
    check = [{"role": "assistant", "content": call}, {"role": "tool", "content": example.answer}]
    # with agreement the checker is asked again about the solver's next proposal: the copy of its reply, or (half
    # the problems, drawn apart so the other demonstrations stay as they were) the wrong proposal repeated; either
    # way it replies with the result, so that agreeing is never echoing the proposal
    repeated = random.Random(f"{seed}:{example.prompt}:second round").random() < 0.5
    second_round = [
        {"role": "user", "content": checker_observation(example, wrong if repeated else example.answer)},
        {"role": "assistant", "content": accept},
    ]
    demonstrations = [
        (CHECKER, checker_observation(example, example.answer), [*check, {"role": "assistant", "content": accept}]),
        (
            CHECKER,
            checker_observation(example, wrong),
            [*check, {"role": "assistant", "content": critique}, *(second_round if agreement else [])],
        ),
    ]
    if answer_demonstrations == 1.0 or rng.random() < answer_demonstrations:
        demonstrations.insert(0, (SOLVER, example.prompt, example.solution))
    if rng.random() < critique_demonstrations:
        guess = wrong if solver_tool else direct_answer(wrong)[0]["content"]
        second = example.answer if critique_copies == 1.0 or rng.random() < critique_copies else guess
        demonstrations.append(
            (
                SOLVER,
                example.prompt,
                [
                    {"role": "assistant", "content": guess, "weight": 0},
                    {"role": "user", "content": critique},
                    {"role": "assistant", "content": second},
                ],
            )
        )
    return demonstrations


def check_options(tool_demonstrations: float, solver_tool: bool, **shares: float) -> None:
    """A ValueError that names the option to fix, for options of ``solver_checker`` that do not fit together."""
    for name, share in shares.items():
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"solver_checker: {name} must be a fraction in [0, 1], got {share}")
    if not isinstance(solver_tool, bool):
        raise ValueError(f"solver_checker: solver_tool must be true or false, got {solver_tool!r}")
    if not solver_tool and tool_demonstrations:
        raise ValueError(
            "solver_checker: with solver_tool false no solver demonstration calls the calculator; set "
            f"tool_demonstrations to 0 (got {tool_demonstrations})"
        )


@TASKS.register("solver_checker")
def solver_checker_task(
    digits: int = 3,
    operations: str = "*",
    num_train: int | None = None,
    num_test: int = 200,
    tool_demonstrations: float = 0.3,
    critique_demonstrations: float = 0.3,
    critique_copies: float = 1.0,
    answer_demonstrations: float = 1.0,
    agreement: bool = False,
    max_rounds: int = 2,
    wrong_accept_penalty: float = 0.1,
    solver_tool: bool = True,
    data_seed: int = 1234,
) -> Task:
    """The calculator problems of ``calculator`` (same options and splits) for a solver and a checker.

    ``tool_demonstrations``: share of solver demonstrations that call the calculator (the rest answer at once);
    ``critique_demonstrations``: share of examples with a demonstration of the solver answering a critique;
    ``critique_copies``: share of those in which the solver copies the critique's result (in the rest it repeats
    its wrong proposal, so that a warm start can leave copying rare for RL to make common);
    ``answer_demonstrations``: share of examples with the solver's demonstration of answering at once (0: a stage
    of critiques only); ``agreement``: the checker replies with the result, and a proposal equal to it is accepted
    (``unipg.envs.solver_checker``); ``max_rounds``: checker replies per episode; ``wrong_accept_penalty``: the
    team's cost of accepting a wrong answer; ``solver_tool``: whether the solver may call the calculator (False:
    only the checker may, and ``tool_demonstrations`` must be 0, as no solver demonstration calls it)."""
    shares = dict(critique_demonstrations=critique_demonstrations, critique_copies=critique_copies)
    shares["answer_demonstrations"] = answer_demonstrations
    check_options(tool_demonstrations, solver_tool, **shares)
    base = calculator_task(
        digits=digits,
        operations=operations,
        num_train=num_train,
        num_test=num_test,
        tool_demonstrations=tool_demonstrations,
        data_seed=data_seed,
    )
    return Task(
        name="solver_checker",
        train=base.train,
        test=base.test,
        system_prompt=None,
        rewards=base.rewards,
        tools=base.tools,
        max_turns=2 * max_rounds + 1,
        roles=dict(ROLE_PROMPTS),
        env="solver_checker",
        env_options={
            "max_rounds": max_rounds,
            "wrong_accept_penalty": wrong_accept_penalty,
            "solver_tool": solver_tool,
            "agreement": agreement,
        },
        role_demonstrations=lambda example: role_demonstrations(
            example, seed=data_seed, solver_tool=solver_tool, agreement=agreement, **shares
        ),
    )
