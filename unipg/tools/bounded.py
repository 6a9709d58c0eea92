"""Limits on computing with text the policy wrote, checked before the computation starts.

Python cannot interrupt a big-integer power or a regular expression: one ``9**9**9**9`` holds the interpreter
lock until it finishes, and every thread of the trainer (Ctrl-C included) waits with it. So a number is parsed
only when its digits and exponent are small (``parse_number``), a power is computed only when its result is
known to be small (``power_bits``), an expression goes to a symbolic library only when it has no power towers,
no large exponents and no factorials of large numbers (``symbolic_refusal``), and even then it is evaluated in
a child interpreter that is killed when it runs past its time (``IsolatedFunction``).
"""

from __future__ import annotations

import importlib
import json
import re
import select
import subprocess
import sys
import threading
from fractions import Fraction
from typing import Any

MAX_NUMBER_DIGITS = 1000  # digits of a number literal in an answer
MAX_DECIMAL_EXPONENT = 400  # |e| in "1.5e12"
MAX_SYMBOLIC_CHARS = 300  # an answer longer than this is not handed to a symbolic library
MAX_SYMBOLIC_EXPONENT = 128  # exponents in an answer handed to a symbolic library
MAX_FACTORIAL = 100  # n in "n!"

_DECIMAL = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE]([+-]?\d+))?")
_RATIO = re.compile(r"[+-]?\d+/\d+")


def parse_number(text: str) -> int | float | Fraction | None:
    """An integer, decimal, ``1.5e-3`` or ``p/q`` written in ``text`` (surrounding spaces allowed), or None when
    ``text`` is none of those or is too large to parse quickly (``MAX_NUMBER_DIGITS``, ``MAX_DECIMAL_EXPONENT``).
    """
    text = text.strip()
    if sum(character.isdigit() for character in text) > MAX_NUMBER_DIGITS:
        return None
    decimal = _DECIMAL.fullmatch(text)
    if decimal is None and _RATIO.fullmatch(text) is None:
        return None
    if decimal is not None and decimal.group(1) is not None and abs(int(decimal.group(1))) > MAX_DECIMAL_EXPONENT:
        return None  # Fraction("1e100000000") would build a 100-million-digit integer
    for parse in (int, float, Fraction):  # Fraction reads "3/4"; float also reads "1e3"
        try:
            return parse(text)
        except (ValueError, ZeroDivisionError, OverflowError):
            continue
    return None


def power_bits(base: Fraction, exponent: int) -> int:
    """An upper bound on the bits of the numerator and of the denominator of ``base ** exponent``, from the
    operands' sizes alone: log2 |base| (or of its denominator) × |exponent|."""
    size = max(abs(base.numerator).bit_length(), base.denominator.bit_length())
    return size * abs(exponent)


# An exponent: a braced group, a parenthesised group, or one token (number, letter, LaTeX command).
_POWER = re.compile(r"\^|\*\*")
_NUMBER_LITERAL = re.compile(r"\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")
_FACTORIAL = re.compile(r"(\d*)\s*!")


def _operand_end(text: str, start: int) -> int:
    """The end of the operand that starts at ``start`` (after spaces): a bracketed group or one token."""
    while start < len(text) and text[start].isspace():
        start += 1
    if start >= len(text):
        return start
    closing = {"{": "}", "(": ")", "[": "]"}.get(text[start])
    if closing is not None:
        depth = 0
        for index in range(start, len(text)):
            depth += text[index] in "{(["
            depth -= text[index] in "})]"
            if depth == 0:
                return index + 1
        return len(text)
    token = re.compile(r"[+-]?(?:\\[A-Za-z]+|\d+(?:\.\d+)?|[A-Za-z])").match(text, start)
    return token.end() if token else start + 1


def symbolic_refusal(text: str) -> str | None:
    """Why ``text`` must not be handed to a symbolic library (sympy, math_verify), or None when it may be.

    Refused: text longer than ``MAX_SYMBOLIC_CHARS``, numbers with more than ``MAX_NUMBER_DIGITS`` digits,
    power towers (``9^9^9``, ``2^{3^4}``, ``2**2**2``), exponents above ``MAX_SYMBOLIC_EXPONENT`` and factorials
    above ``MAX_FACTORIAL`` (or of anything but a number).
    """
    if len(text) > MAX_SYMBOLIC_CHARS:
        return f"longer than {MAX_SYMBOLIC_CHARS} characters"
    if re.search(rf"\d{{{MAX_NUMBER_DIGITS + 1}}}", text):
        return f"a number with more than {MAX_NUMBER_DIGITS} digits"
    for power in _POWER.finditer(text):
        end = _operand_end(text, power.end())
        exponent = text[power.end() : end]
        if _POWER.search(exponent) or _POWER.match(text[end:].lstrip()):
            return "a power tower"
        for literal in _NUMBER_LITERAL.findall(exponent):
            if len(literal) > 12 or float(literal) > MAX_SYMBOLIC_EXPONENT:
                return f"an exponent above {MAX_SYMBOLIC_EXPONENT}"
    for factorial in _FACTORIAL.finditer(text):
        if not factorial.group(1) or len(factorial.group(1)) > 4 or int(factorial.group(1)) > MAX_FACTORIAL:
            return f"a factorial of something other than a number up to {MAX_FACTORIAL}"
    return None


class IsolatedFunction:
    """``module:function`` called in a child interpreter, one call at a time; a call that runs past ``timeout``
    seconds kills the child and raises ``TimeoutError`` (the next call starts a fresh child).

    Arguments and results travel as JSON. Waiting on the child releases the interpreter lock, so whatever the
    function computes, the calling process keeps running. ``kills`` counts the children killed. ``preload`` names
    modules the child imports before it is ready (within ``start_timeout``), so that ``timeout`` measures what a
    call computes, not the imports the function would do on its first call.
    """

    def __init__(
        self, target: str, *, timeout: float = 5.0, start_timeout: float = 120.0, preload: tuple[str, ...] = ()
    ):
        self.target, self.timeout, self.start_timeout, self.preload = target, timeout, start_timeout, preload
        self.kills = 0
        self._lock = threading.Lock()
        self._child: subprocess.Popen | None = None

    def __call__(self, *arguments: Any) -> Any:
        with self._lock:
            if self._child is None or self._child.poll() is not None:
                self._child = self._start()
            self._child.stdin.write(json.dumps(arguments) + "\n")
            self._child.stdin.flush()
            return json.loads(self._read_line(self.timeout))

    def _start(self) -> subprocess.Popen:
        self._child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, self.target, *self.preload],
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._read_line(self.start_timeout)  # the child says "ready" once its imports are done
        return self._child

    def _read_line(self, timeout: float) -> str:
        child = self._child
        readable, _, _ = select.select([child.stdout], [], [], timeout)
        line = child.stdout.readline() if readable else ""
        if not line:
            self.close()
            self.kills += 1
            raise TimeoutError(
                f"{self.target} gave no answer within {timeout:g} s (it ran too long or failed); its process was killed"
            )
        return line

    def close(self) -> None:
        """Kill the child, if any (a later call starts a new one)."""
        child, self._child = self._child, None
        if child is not None:
            child.kill()
            child.wait()
            child.stdin.close()
            child.stdout.close()


_CHILD = "import sys; from unipg.tools.bounded import serve; serve(sys.argv[1], sys.argv[2:])"


def serve(target: str, preload: list[str] = ()) -> None:
    """The child's loop: import ``preload``, then read JSON argument lists from stdin and write the function's JSON
    results to stdout."""
    for name in preload:
        importlib.import_module(name)
    module, name = target.split(":")
    function = getattr(importlib.import_module(module), name)
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(function(*json.loads(line))), flush=True)
