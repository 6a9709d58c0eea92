"""A weighted sum of reward functions (``CombinedReward``), and the checks on what each function returns.

What a reward function may return: a list, tuple, 1-D NumPy array or 1-D tensor with one entry per completion,
each a finite real number (bools, NumPy and 0-d tensor scalars included) or None. Anything else — the wrong
length, NaN or ±inf, strings, nested lists — raises ``RewardFunctionError`` naming the function and the first
bad entry, as does an exception raised by the function (kept as the error's ``__cause__``).

A sync function may carry an async twin as its ``acall`` attribute (the ``math`` reward's waits for its child
processes on a worker thread): ``CombinedReward.acall`` awaits the twin, so that waiting does not hold the event
loop the episodes run on.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable

RewardFunction = Callable[..., Any]  # (prompts, completions, **columns) -> list[float | None] (or awaitable);
# a function without **kwargs is given only the columns it names


class RewardFunctionError(ValueError, RuntimeError):
    """A reward function raised, or returned something that is not one finite float or None per completion.

    A ValueError, so that the command line reports it in one line like other bad input; a RuntimeError too,
    since the function failed while it ran.
    """


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
        self._signatures = [_parameters(function) for _, function, _ in self.functions]  # read once, not per call

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
        started = self._start(prompts, completions, columns, twins=True)
        return self._combine(await self._settle(started), len(completions))

    def _start(self, prompts: list, completions: list, columns: dict, *, twins: bool = False) -> list:
        """Each function's output: its rewards, or for an async function the coroutine producing them; with
        ``twins``, a function's async twin (its ``acall``) is called in its place."""
        calls = [
            (name, function, columns_taken(name, parameters, columns))
            for (name, function, _), parameters in zip(self.functions, self._signatures)
        ]
        started = []
        for name, function, taken in calls:
            call = getattr(function, "acall", None) if twins else None
            try:
                started.append((call or function)(prompts, completions, **taken))
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
        per_function = {name: _checked_rewards(name, out, num_samples) for name, out in zip(self.names, outputs)}
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


def columns_taken(name: str, parameters: list[inspect.Parameter] | None, columns: dict) -> dict:
    """The columns a function with these ``parameters`` (``_parameters``) is called with: every one when it takes
    ``**kwargs`` (TRL's convention) or has no readable signature, else those it names. A parameter without a
    default that names no column is a RewardFunctionError listing the columns."""
    if parameters is None or any(p.kind is p.VAR_KEYWORD for p in parameters):
        return columns
    named = [p for p in parameters[2:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    missing = [p.name for p in named if p.default is p.empty and p.name not in columns]
    if missing:
        raise RewardFunctionError(
            f"reward function '{name}' needs the column(s) {', '.join(missing)}, which the task "
            f"does not have; its columns: {', '.join(sorted(columns)) or 'none'}"
        )
    return {p.name: columns[p.name] for p in named if p.name in columns}


def _parameters(function: RewardFunction) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable without a signature: give it every column
        return None


def _failed(name: str, error: Exception) -> RewardFunctionError:
    """The error for a reward function that raised ``error``: its name and the first line of the message."""
    lines = str(error).strip().splitlines()
    reason = lines[0] if lines else "no message"
    return RewardFunctionError(
        f"reward function '{name}' failed: {reason} ({type(error).__name__}); fix the "
        "function, or leave it out of the rewards (its traceback is this error's cause)"
    )


def _checked_rewards(name: str, output: Any, num_samples: int) -> list[float | None]:
    """``output`` as a list of finite floats or None, one per completion, or a RewardFunctionError naming the
    function and the first bad entry (module docstring: what is accepted)."""
    expected = "a list with one float (or None) per completion"
    if isinstance(output, (str, bytes, dict, set, frozenset)) or getattr(output, "ndim", 1) != 1:
        shape = f" of shape {tuple(output.shape)}" if hasattr(output, "shape") else ""
        raise RewardFunctionError(
            f"reward function '{name}' returned a {type(output).__name__}{shape} for "
            f"{num_samples} completions; it must return {expected}"
        )
    try:
        length = len(output)
    except TypeError:
        length = None
    if length != num_samples:
        got = f"{length} values" if length is not None else f"a {type(output).__name__}"
        raise RewardFunctionError(
            f"reward function '{name}' returned {got} for {num_samples} completions; it must return {expected}"
        )
    return [_checked_value(name, index, value) for index, value in enumerate(output)]


def _checked_value(name: str, index: int, value: Any) -> float | None:
    if value is None:
        return None
    where = f"reward function '{name}' returned {_shown(value)} for completion {index}"
    if getattr(value, "ndim", 0) != 0 or not _is_real(value):
        raise RewardFunctionError(f"{where}; each value must be a real number, or None where the reward does not apply")
    try:
        number = float(value.detach() if hasattr(value, "detach") else value)  # a tensor may require grad
    except (ValueError, OverflowError):  # a signalling NaN Decimal, an integer beyond float range
        number = math.nan
    if not math.isfinite(number):
        raise RewardFunctionError(
            f"{where}; rewards must be finite: return None where the reward does not apply, or clip the value"
        )
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
