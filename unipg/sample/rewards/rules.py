"""Rewards for text completions, with the reward-function contract of TRL's ``GRPOTrainer``.

A reward function is a plain callable ``reward(prompts, completions, **columns) -> list[float | None]``:
one value per completion, ``None`` meaning "not applicable to this sample". Prompts and completions are
strings or conversations (lists of ``{"role", "content"}`` messages); ``columns`` are lists aligned with
the completions, e.g. ``answer=[...]`` from the task's ``Example.columns``. A reward function may be an
``async def``; ``CombinedReward`` awaits those concurrently.

``REWARDS`` holds factories: ``REWARDS.get("math")(tolerance=1e-6)`` returns a reward function.
``build_rewards([{"name": "math", "weight": 1.0}, {"name": "format", "weight": 0.1}])`` combines several
into a weighted sum.

What a reward function may return: a list, tuple, 1-D NumPy array or 1-D tensor with one entry per completion,
each a finite real number (bools, NumPy and 0-d tensor scalars included) or None. Anything else — the wrong
length, NaN or ±inf, strings, nested lists — raises ``RewardFunctionError`` naming the function and the first
bad entry, as does an exception raised by the function (kept as the error's ``__cause__``). A training run
stops on it: a broken reward would otherwise train the policy on wrong signals without anyone noticing.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import numbers
import re
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable

from unipg.estimate.registry import Registry
from unipg.sample.answers import extract_final_answer, normalize_answer
from unipg.sample.tasks.base import validate_options

RewardFunction = Callable[..., Any]  # (prompts, completions, **columns) -> list[float | None] (or awaitable)
REWARDS = Registry("reward")


class RewardFunctionError(ValueError, RuntimeError):
    """A reward function raised, or returned something that is not one finite float or None per completion.

    A ValueError, so that the command line reports it in one line like other bad input; a RuntimeError too,
    since the function failed while it ran.
    """


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
    """Whether two final answers denote the same number or expression.

    Fast path, deciding most calls in microseconds: when both strings are integers they must be equal; when
    both are numbers (decimals or fractions ``p/q``), |predicted − reference| ≤ tolerance. Only otherwise
    (LaTeX, radicals, expressions) fall back to ``math_verify`` when installed, else to sympy.
    """
    predicted, reference = normalize_answer(predicted), normalize_answer(reference)
    if predicted == reference:
        return True
    predicted_number, reference_number = _as_number(predicted), _as_number(reference)
    if predicted_number is not None and reference_number is not None:
        if isinstance(predicted_number, int) and isinstance(reference_number, int):
            return predicted_number == reference_number  # exact, even beyond float precision
        try:
            return abs(float(predicted_number) - float(reference_number)) <= tolerance
        except OverflowError:  # a number too large for a float is not within tolerance of a smaller one
            return False
    verifier = _math_verify()
    if verifier is not None:
        return _math_verify_equal(verifier, predicted, reference)
    return _sympy_equal(predicted, reference, tolerance=tolerance)


def _as_number(text: str) -> int | float | Fraction | None:
    for parse in (int, float, Fraction):  # Fraction reads "3/4"; float also reads "1e3"
        try:
            return parse(text)
        except (ValueError, ZeroDivisionError, OverflowError):
            continue
    return None


@functools.lru_cache(maxsize=1)
def _math_verify() -> tuple[Callable, Callable] | None:
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    return parse, verify


def _math_verify_equal(verifier: tuple[Callable, Callable], predicted: str, reference: str) -> bool:
    parse, verify = verifier
    # math_verify enforces its timeouts with SIGALRM, which only the main thread may install.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        gold = parse(reference, parsing_timeout=timeout) or parse(f"${reference}$", parsing_timeout=timeout)
        target = parse(predicted, parsing_timeout=timeout) or parse(f"${predicted}$", parsing_timeout=timeout)
        return bool(gold and target and verify(gold, target, timeout_seconds=timeout))
    except Exception:  # any failure to parse or compare means "not shown equal"
        return False


# sympy parses by evaluating Python, so only plain arithmetic is let through: digits, operators, brackets,
# sqrt and pi. Powers are left out because "9**9**9**9" would hang the comparison.
_SAFE_EXPRESSION = re.compile(r"[\d\s.+\-*/()]+")


def _sympy_equal(predicted: str, reference: str, *, tolerance: float) -> bool:
    """|predicted − reference| ≤ tolerance after sympy evaluates both plain arithmetic expressions."""
    import sympy

    for text in (predicted, reference):
        if len(text) > 100 or "**" in text or not _SAFE_EXPRESSION.fullmatch(re.sub(r"sqrt|pi", "", text)):
            return False
    try:
        difference = sympy.sympify(predicted, rational=True) - sympy.sympify(reference, rational=True)
        return abs(complex(sympy.N(difference))) <= tolerance
    except Exception:  # SympifyError, TypeError, SyntaxError, ZeroDivisionError, ...: not shown equal
        return False


# ---------------------------------------------------------------------------------------------------------
# Rule-based rewards


def _score_final_answers(name: str, completions: list, columns: dict,
                         matches: Callable[[str, str], bool]) -> list[float | None]:
    """1.0 where the completion's final answer matches the reference, 0.0 where not (or none is given),
    None where the reference answer is None."""
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
        return _score_final_answers("exact_match", completions, columns,
                                    lambda predicted, reference: predicted == normalize_answer(reference))

    return exact_match_reward


@REWARDS.register("math")
def math_reward(tolerance: float = 1e-6) -> RewardFunction:
    """1.0 when the completion's final answer is numerically or symbolically equal to the reference, else 0.0.

    See ``answers_equivalent``; a completion without a final answer scores 0.0, a sample whose reference
    answer is None gets None.
    """

    def math_equivalence_reward(prompts: list, completions: list, **columns) -> list[float | None]:
        return _score_final_answers(
            "math", completions, columns,
            lambda predicted, reference: answers_equivalent(predicted, reference, tolerance=tolerance))

    return math_equivalence_reward


@REWARDS.register("format")
def format_reward(pattern: str = r"####\s*-?[\d,]*\.?\d+\s*$") -> RewardFunction:
    """1.0 when ``re.search(pattern, completion.strip())`` matches, else 0.0; by default ``#### <number>``."""
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


# ---------------------------------------------------------------------------------------------------------
# Weighted combination


@dataclass
class RewardResult:
    """The combined reward of a batch of completions and what each reward function said."""

    total: list[float]  # (N,) Σ_f w_f · r_f over the functions that applied (non-None); 0.0 if none did
    per_function: dict[str, list[float | None]]  # name -> (N,) unweighted rewards, None = not applicable
    not_applicable: int  # samples that no function applied to (their total is 0.0)

    def means(self) -> dict[str, float]:
        """Mean of each function's applicable (non-None) rewards, for logging; skips functions with none."""
        means = {}
        for name, values in self.per_function.items():
            applicable = [value for value in values if value is not None]
            if applicable:
                means[name] = sum(applicable) / len(applicable)
        return means


class CombinedReward:
    """A weighted sum of reward functions; sync ones are called in turn, async ones awaited concurrently."""

    def __init__(self, functions: list[tuple[str, RewardFunction, float]]):
        self.functions: list[tuple[str, RewardFunction, float]] = []
        used: set[str] = set()
        for name, function, weight in functions:
            if not callable(function):
                raise TypeError(f"reward '{name}' is not callable: {function!r}")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ValueError(f"reward '{name}': weight must be a number and finite, got {weight!r}")
            unique = name
            for suffix in range(2, len(functions) + 2):  # two "length" rewards log as length, length_2
                if unique not in used:
                    break
                unique = f"{name}_{suffix}"
            used.add(unique)
            self.functions.append((unique, function, float(weight)))

    @classmethod
    def from_callables(cls, functions: list[tuple[RewardFunction, float]]) -> CombinedReward:
        """Combine user-written reward functions, each named by its ``__name__``."""
        return cls([(getattr(fn, "__name__", type(fn).__name__), fn, weight) for fn, weight in functions])

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.functions]

    def __call__(self, prompts: list, completions: list, **columns) -> RewardResult:
        started = self._start(prompts, completions, columns)
        if any(inspect.isawaitable(output) for output in started):
            if _event_loop_running():
                _close_coroutines(started)
                raise RuntimeError(
                    "async reward functions cannot be run from inside a running event loop by calling the "
                    "combined reward; use `await combined_reward.acall(prompts, completions, **columns)`"
                )
            started = asyncio.run(self._settle(started))
        return self._combine(started, len(completions))

    async def acall(self, prompts: list, completions: list, **columns) -> RewardResult:
        """Like calling the combined reward, from inside a running event loop."""
        started = self._start(prompts, completions, columns)
        return self._combine(await self._settle(started), len(completions))

    def _start(self, prompts: list, completions: list, columns: dict) -> list:
        """Each function's output: its rewards, or for an async function the coroutine producing them."""
        started = []
        for name, function, _ in self.functions:
            try:
                started.append(function(prompts, completions, **columns))
            except Exception as err:
                _close_coroutines(started)
                raise _failed(name, err) from err
        return started

    async def _settle(self, started: list) -> list:
        async def settle_one(name: str, output: Any) -> Any:
            if not inspect.isawaitable(output):
                return output
            try:
                return await output
            except Exception as err:
                raise _failed(name, err) from err

        tasks = [asyncio.ensure_future(settle_one(name, output)) for name, output in zip(self.names, started)]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:  # one function failed: the others' results are not needed
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # collect them, so none is reported as lost
            raise

    def _combine(self, outputs: list, num_samples: int) -> RewardResult:
        per_function = {
            name: _checked_rewards(name, out, num_samples) for name, out in zip(self.names, outputs)
        }
        total, not_applicable = [], 0
        for sample in range(num_samples):
            applicable = [
                (weight, per_function[name][sample])
                for name, _, weight in self.functions
                if per_function[name][sample] is not None
            ]
            if not applicable:
                not_applicable += 1
            total.append(sum(weight * value for weight, value in applicable))
        return RewardResult([float(value) for value in total], per_function, not_applicable)


def _failed(name: str, error: Exception) -> RewardFunctionError:
    """The error for a reward function that raised ``error``: its name and the first line of the message."""
    lines = str(error).strip().splitlines()
    reason = lines[0] if lines else "no message"
    return RewardFunctionError(f"reward function '{name}' failed: {reason} ({type(error).__name__}); fix the "
                               "function, or leave it out of the rewards (its traceback is this error's cause)")


def _checked_rewards(name: str, output: Any, num_samples: int) -> list[float | None]:
    """``output`` as a list of finite floats or None, one per completion, or a RewardFunctionError naming the
    function and the first bad entry (module docstring: what is accepted)."""
    expected = "a list with one float (or None) per completion"
    if isinstance(output, (str, bytes, dict, set, frozenset)) or getattr(output, "ndim", 1) != 1:
        shape = f" of shape {tuple(output.shape)}" if hasattr(output, "shape") else ""
        raise RewardFunctionError(f"reward function '{name}' returned a {type(output).__name__}{shape} for "
                                  f"{num_samples} completions; it must return {expected}")
    try:
        length = len(output)
    except TypeError:
        length = None
    if length != num_samples:
        got = f"{length} values" if length is not None else f"a {type(output).__name__}"
        raise RewardFunctionError(f"reward function '{name}' returned {got} for {num_samples} completions; "
                                  f"it must return {expected}")
    return [_checked_value(name, index, value) for index, value in enumerate(output)]


def _checked_value(name: str, index: int, value: Any) -> float | None:
    if value is None:
        return None
    where = f"reward function '{name}' returned {_shown(value)} for completion {index}"
    if getattr(value, "ndim", 0) != 0 or not _is_real(value):
        raise RewardFunctionError(f"{where}; each value must be a real number, or None where the reward does "
                                  "not apply")
    try:
        number = float(value.detach() if hasattr(value, "detach") else value)  # a tensor may require grad
    except (ValueError, OverflowError):  # a signalling NaN Decimal, an integer beyond float range
        number = math.nan
    if not math.isfinite(number):
        raise RewardFunctionError(f"{where}; rewards must be finite: return None where the reward does not "
                                  "apply, or clip the value")
    return number


def _is_real(value: Any) -> bool:
    """Whether ``value`` is a real number: a Python, NumPy or Decimal number, a bool, a 0-d array or tensor."""
    if isinstance(value, numbers.Number):
        return isinstance(value, numbers.Real) or not isinstance(value, numbers.Complex)  # Decimal: yes
    dtype = getattr(value, "dtype", None)
    if dtype is None:  # strings, lists, dicts, ...
        return False
    if hasattr(dtype, "kind"):  # NumPy: bool, signed, unsigned, float
        return dtype.kind in "biuf"
    return not getattr(dtype, "is_complex", True)  # torch


def _shown(value: Any) -> str:
    """The type and value of ``value`` for an error message: "float nan", "str '1.0'", "Tensor tensor(inf)"."""
    text = str(value) if isinstance(value, numbers.Number) or hasattr(value, "dtype") else repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"


def _event_loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _close_coroutines(outputs: list) -> None:
    for output in outputs:
        if inspect.iscoroutine(output):
            output.close()  # never awaited: close it so Python does not warn


def build_rewards(spec: list[dict]) -> CombinedReward:
    """A CombinedReward from ``[{"name": ..., "weight": 1.0, **options}, ...]`` using the ``REWARDS`` registry.

    An unknown name raises RegistryError listing the valid ones; an unknown or missing option raises
    ValueError naming the reward and the options it accepts.
    """
    functions = []
    for item in spec:
        if not isinstance(item, dict) or "name" not in item:
            example = {"name": "math", "weight": 1.0}
            raise ValueError(f"each reward must be a dict with a 'name', e.g. {example}; got {item!r}")
        options = dict(item)
        name, weight = options.pop("name"), options.pop("weight", 1.0)
        factory = REWARDS.get(name)
        validate_options("reward", name, factory, options)
        functions.append((name, factory(**options), weight))
    return CombinedReward(functions)

