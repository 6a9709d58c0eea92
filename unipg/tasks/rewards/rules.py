"""Rewards for text completions, with the reward-function contract of TRL's ``GRPOTrainer``.

A reward function is a plain callable ``reward(prompts, completions, **columns) -> list[float | None]``:
one value per completion, ``None`` meaning "not applicable to this sample". Prompts and completions are
strings or conversations (lists of ``{"role", "content"}`` messages); ``columns`` are lists aligned with
the completions, e.g. ``answer=[...]`` from the task's ``Example.columns``. A reward function may be an
``async def``; ``CombinedReward`` awaits those concurrently.

``REWARDS`` holds factories: ``REWARDS.get("math")(tolerance=1e-6)`` returns a reward function.
``build_rewards([{"name": "math", "weight": 1.0}, {"name": "length", "weight": 0.1, "options": {"max_length": 200}}])``
combines several into a weighted sum (``CombinedReward``, in ``unipg.tasks.rewards.combine``).

What a reward function may return: a list, tuple, 1-D NumPy array or 1-D tensor with one entry per completion,
each a finite real number (bools, NumPy and 0-d tensor scalars included) or None. Anything else — the wrong
length, NaN or ±inf, strings, nested lists — raises ``RewardFunctionError`` naming the function and the first
bad entry, as does an exception raised by the function (kept as the error's ``__cause__``). A training run
stops on it: a broken reward would otherwise train the policy on wrong signals without anyone noticing.
"""

from __future__ import annotations

import inspect
import re
import warnings
from typing import Any, Callable

from unipg._moved import UnipgDeprecationWarning
from unipg.config.specs import reward_spec
from unipg.registry import FactoryRegistry, validate_options
from unipg.tasks.answers import extract_final_answer, normalize_answer
from unipg.tasks.rewards.combine import (  # noqa: F401  (the combination, importable from here)
    CombinedReward,
    RewardFunction,
    RewardFunctionError,
    RewardResult,
)
from unipg.tasks.rewards.symbolic import BATCH_TIMEOUT, SYMBOLIC_TIMEOUT, in_daemon_thread, symbolic_pool
from unipg.tools.bounded import parse_number, symbolic_refusal

REWARDS = FactoryRegistry("reward")  # a factory's keyword parameters are the reward's options


# ---------------------------------------------------------------------------------------------------------
# Text of plain and conversational samples


def text_of(sample: Any, role: str | None = None) -> str:
    """The text of a prompt or completion: the string itself, or the content of a conversation's last message.

    With ``role`` (e.g. "assistant"), the last message of that role when there is one.
    """
    if isinstance(sample, str):
        return sample
    if isinstance(sample, dict):
        return _content_text(sample.get("content"))
    if isinstance(sample, (list, tuple)):
        if not sample:
            return ""
        of_role = [message for message in sample if role is not None and message.get("role") == role]
        return _content_text((of_role or list(sample))[-1].get("content"))
    kind = type(sample).__name__
    raise TypeError(f"expected a string or a list of {{'role', 'content'}} messages, got {kind}")


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # multimodal content: [{"type": "text", "text": ...}, ...]
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def _reference_answers(reward: str, completions: list, columns: dict) -> list:
    if "answer" not in columns:
        raise ValueError(
            f"reward '{reward}' needs an 'answer' column (one reference answer per completion); "
            f"got columns: {', '.join(sorted(columns)) or 'none'}"
        )
    return list(columns["answer"])


# ---------------------------------------------------------------------------------------------------------
# Answer equivalence


def answers_equivalent(predicted: str, reference: str, *, tolerance: float = 1e-6) -> bool:
    r"""Whether two final answers denote the same number or expression.

    Fast path, deciding most calls in microseconds: when both strings are integers they must be equal; when
    both are numbers (decimals or fractions ``p/q``), |predicted − reference| ≤ tolerance. Only otherwise
    (LaTeX such as ``\frac{3}{4}`` or ``\sqrt{2}/2``, expressions) ``math_verify`` compares them, and sympy where
    math_verify cannot parse one of them — in a child process killed after ``SYMBOLIC_TIMEOUT`` seconds
    (``unipg.tasks.rewards.symbolic``), and only for answers ``symbolic_refusal`` lets through (no power towers,
    huge exponents or factorials): a policy's ``9^9^9^9`` scores 0.0 at once.
    """
    return answers_equivalent_all([(predicted, reference)], tolerance=tolerance)[0]


def answers_equivalent_all(
    pairs: list[tuple[str, str]],
    *,
    tolerance: float = 1e-6,
    timeout: float = SYMBOLIC_TIMEOUT,
    batch_timeout: float = BATCH_TIMEOUT,
) -> list[bool]:
    """``answers_equivalent`` of each ``(predicted, reference)`` pair; the pairs that need a symbolic library are
    compared in parallel, each within ``timeout`` seconds and all within ``batch_timeout`` (``SymbolicPool``)."""
    pairs = [(normalize_answer(predicted), normalize_answer(reference)) for predicted, reference in pairs]
    quick = [_quick_verdict(predicted, reference, tolerance) for predicted, reference in pairs]
    symbolic = [pair for pair, verdict in zip(pairs, quick) if verdict is None]
    if not symbolic:
        return quick
    shown = iter(symbolic_pool().compare(symbolic, tolerance=tolerance, timeout=timeout, batch_timeout=batch_timeout))
    return [next(shown) if verdict is None else verdict for verdict in quick]


async def answers_equivalent_async(predicted: str, reference: str, *, tolerance: float = 1e-6) -> bool:
    """``answers_equivalent`` for a coroutine: a pair that needs a symbolic library waits on a worker thread,
    not on the event loop."""
    if (verdict := quick_verdict(predicted, reference, tolerance)) is not None:
        return verdict
    return await in_daemon_thread(answers_equivalent, predicted, reference, tolerance=tolerance)


def quick_verdict(predicted: str, reference: str, tolerance: float) -> bool | None:
    """The verdict on two answers without a symbolic library; None when one must decide."""
    return _quick_verdict(normalize_answer(predicted), normalize_answer(reference), tolerance)


def _quick_verdict(predicted: str, reference: str, tolerance: float) -> bool | None:
    """The verdict on two normalized answers without a symbolic library; None when one must decide."""
    if predicted == reference:
        return True
    predicted_number, reference_number = parse_number(predicted), parse_number(reference)
    if predicted_number is not None and reference_number is not None:
        if isinstance(predicted_number, int) and isinstance(reference_number, int):
            return predicted_number == reference_number  # exact, even beyond float precision
        try:
            return abs(float(predicted_number) - float(reference_number)) <= tolerance
        except OverflowError:  # a number too large for a float is not within tolerance of a smaller one
            return False
    if symbolic_refusal(predicted) is not None or symbolic_refusal(reference) is not None:
        return False
    return None


# ---------------------------------------------------------------------------------------------------------
# Rule-based rewards


def _score_final_answers(
    name: str, completions: list, columns: dict, matches: Callable[[str, str], bool | float]
) -> list[float | None]:
    """1.0 where the completion's final answer matches the reference, 0.0 where not (or none is given),
    None where the reference answer is None; a ``matches`` that returns a number gives partial credit."""
    scores: list[float | None] = []
    for completion, reference in zip(completions, _reference_answers(name, completions, columns)):
        if reference is None:
            scores.append(None)
            continue
        predicted = extract_final_answer(text_of(completion, "assistant"))
        scores.append(float(predicted is not None and matches(predicted, str(reference))))
    return scores


@REWARDS.register("exact_match")
def exact_match() -> RewardFunction:
    """1.0 when the completion's final answer (``extract_final_answer``) equals the reference, else 0.0."""

    def exact_match_reward(prompts: list, completions: list, **columns) -> list[float | None]:
        return _score_final_answers(
            "exact_match", completions, columns, lambda predicted, reference: predicted == normalize_answer(reference)
        )

    return exact_match_reward


@REWARDS.register("math")
def math_reward(
    tolerance: float = 1e-6, timeout: float = SYMBOLIC_TIMEOUT, batch_timeout: float = BATCH_TIMEOUT
) -> RewardFunction:
    """1.0 when the completion's final answer is numerically or symbolically equal to the reference, else 0.0.

    See ``answers_equivalent_all``: a symbolic comparison is cut after ``timeout`` seconds, and a call's
    comparisons together after ``batch_timeout`` (an answer cut there scores 0.0). A completion without a
    final answer scores 0.0, a sample whose reference answer is None gets None.
    """
    if not (timeout > 0 and batch_timeout > 0):
        raise ValueError(
            f"reward 'math': timeout and batch_timeout must be > 0 seconds, got {timeout}, {batch_timeout}"
        )

    def answer_pairs(completions: list, columns: dict) -> list[tuple[str, str]]:
        references = _reference_answers("math", completions, columns)
        predicted = [extract_final_answer(text_of(completion, "assistant")) for completion in completions]
        return [(p, str(r)) for p, r in zip(predicted, references) if p is not None and r is not None]

    def math_equivalence_reward(prompts: list, completions: list, **columns) -> list[float | None]:
        pairs = answer_pairs(completions, columns)
        verdicts = answers_equivalent_all(pairs, tolerance=tolerance, timeout=timeout, batch_timeout=batch_timeout)
        shown = dict(zip(pairs, verdicts))
        return _score_final_answers("math", completions, columns, lambda p, r: shown[(p, r)])

    async def acall(prompts: list, completions: list, **columns) -> list[float | None]:
        """The same scores for ``CombinedReward.acall``: on the event loop when every answer is decided without a
        symbolic library (microseconds, e.g. integers), else waited for on a worker thread while the loop runs on."""
        if all(quick_verdict(p, r, tolerance) is not None for p, r in answer_pairs(completions, columns)):
            return math_equivalence_reward(prompts, completions, **columns)
        return await in_daemon_thread(math_equivalence_reward, prompts, completions, **columns)

    math_equivalence_reward.acall = acall
    return math_equivalence_reward


_INTEGER = re.compile(r"-?\d+")


def digit_agreement(predicted: str, reference: str) -> float:
    """The share of digit places, aligned at the units place, in which two integers agree (over the longer of
    the two; opposite signs or a non-integer: 0).

    >>> digit_agreement("153", "143"), digit_agreement("43", "143"), digit_agreement("-7", "7")
    (0.6666666666666666, 0.6666666666666666, 0.0)
    """
    predicted, reference = normalize_answer(predicted), normalize_answer(reference)
    if not (_INTEGER.fullmatch(predicted) and _INTEGER.fullmatch(reference)):
        return 0.0
    if predicted.startswith("-") != reference.startswith("-"):
        return 0.0
    predicted, reference = predicted.lstrip("-")[::-1], reference.lstrip("-")[::-1]
    return sum(a == b for a, b in zip(predicted, reference)) / max(len(predicted), len(reference))


@REWARDS.register("digits")
def digits_reward() -> RewardFunction:
    """Partial credit for an integer answer: the share of its digit places that agree with the reference's,
    aligned at the units place (``digit_agreement``); 1.0 for the exact answer. A denser signal than exact match
    for arithmetic, where an answer with one wrong carry still has most places right; combine it with ``math``
    at a lower weight so that the exact answer stays the goal."""

    def digit_credit_reward(prompts: list, completions: list, **columns) -> list[float | None]:
        return _score_final_answers("digits", completions, columns, digit_agreement)

    return digit_credit_reward


@REWARDS.register("format")
def format_reward(pattern: str = r"####\s*-?(?:[\d,]*[.,])?\d+\s*$") -> RewardFunction:
    """1.0 when ``re.search(pattern, completion.strip())`` matches, else 0.0; by default ``#### <number>``.

    The default pattern has one way to match each string (no nested choices between digit runs), so it takes
    linear time on any completion; a custom pattern should too.
    """
    try:
        compiled = re.compile(pattern)
    except re.error as err:
        message = f"reward 'format': pattern {pattern!r} is not a valid regular expression: {err}"
        raise ValueError(message) from None

    def format_match_reward(prompts: list, completions: list, **columns) -> list[float | None]:
        return [float(compiled.search(text_of(c, "assistant").strip()) is not None) for c in completions]

    return format_match_reward


@REWARDS.register("length")
def length_penalty(max_length: int, penalty: float = 1.0) -> RewardFunction:
    """Soft overlong penalty in the style of DAPO (Yu et al. 2025, eq. 13), measured in characters.

    r = −penalty · min(1, max(0, len − max_length) / max_length): 0 up to ``max_length`` characters,
    falling linearly to −penalty at twice that length, and staying there.
    """
    if not isinstance(max_length, int) or max_length <= 0:
        raise ValueError(f"reward 'length': max_length must be a positive integer, got {max_length!r}")

    def overlong_penalty(prompts: list, completions: list, **columns) -> list[float | None]:
        overshoots = [max(0, len(text_of(c, "assistant")) - max_length) / max_length for c in completions]
        return [-penalty * min(1.0, overshoot) for overshoot in overshoots]

    return overlong_penalty


def reward_defaults(config) -> dict[str, Any]:
    """The run's settings that a reward taking them (a reward model's ``device`` and ``dtype``) gets unless its
    entry sets its own: the reward model lives beside the policy. With ``backend: ray`` the rewards are built here
    and sent to rollout workers that may have no GPU, so there it defaults to the CPU."""
    return {"device": "cpu" if config.backend == "ray" else config.device, "dtype": config.model.dtype}


def build_rewards(spec: list[dict], *, defaults: dict[str, Any] | None = None) -> CombinedReward:
    """A CombinedReward from ``[{"name": ..., "weight": 1.0, "options": {...}}, ...]`` using the ``REWARDS``
    registry (weight 1.0 and no options when left out).

    An unknown name raises RegistryError listing the valid ones; an unknown or missing option raises
    ValueError naming the reward and the options it accepts. ``defaults`` (``reward_defaults``) fill the
    options a reward accepts and its entry leaves out. An entry with its options beside the name
    (``{"name": "length", "max_length": 200}``) is read with a ``UnipgDeprecationWarning`` that shows the nested
    form.
    """
    functions = []
    for index, item in enumerate(spec):
        item, reshaped = reward_spec(item, f"rewards[{index}]")
        if reshaped:
            warnings.warn(reshaped, UnipgDeprecationWarning, stacklevel=2)
        if not isinstance(item, dict) or "name" not in item:
            example = {"name": "math", "weight": 1.0}
            raise ValueError(f"each reward must be a dict with a 'name', e.g. {example}; got {item!r}")
        name, weight, options = item["name"], item.get("weight", 1.0), item.get("options", {})
        if not isinstance(options, dict):
            raise ValueError(
                f"reward '{name}': options must be a mapping of option names to values, e.g. "
                f"{{'max_length': 200}}; got {options!r}"
            )
        validate_options(REWARDS, name, options)
        factory = REWARDS.get(name)
        accepted = inspect.signature(factory).parameters
        options = {**{key: value for key, value in (defaults or {}).items() if key in accepted}, **options}
        functions.append((name, factory(**options), weight))
    return CombinedReward(functions)
