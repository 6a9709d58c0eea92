"""A calculator tool: exact arithmetic on a parsed expression, never ``eval``.

The expression is parsed with ``ast`` and only number literals, + - * / // % **, unary signs and
parentheses are evaluated, on Python integers and ``Fraction``s, so "4738*29" is exact and "7/3" is a
fraction rounded only when printed. Exponents and the digits of every result's numerator and denominator are
bounded, and a power is refused before it is computed when its operands' sizes say its result would be too
large, so that neither "9**9**9" nor "((1/3**64)**64)**64" can hold the process.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

from unipg.tools.base import TOOLS, Tool, ToolError, tool
from unipg.tools.bounded import power_bits

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64  # |b| in a**b; large enough for any task, small enough to stay instant
MAX_RESULT_DIGITS = 100  # of a result's numerator and of its denominator
_MAX_POWER_BITS = 4 * MAX_RESULT_DIGITS  # above log2(10) bits per digit: a power past it has too many digits

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate_expression(expression: str) -> Fraction:
    """The exact value of an arithmetic expression; ToolError says what is not allowed."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {expression!r}; use numbers, + - * / // % ** and parentheses") from None
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (right.denominator != 1 or abs(right) > MAX_EXPONENT):
            raise ToolError(f"exponents must be whole numbers of at most {MAX_EXPONENT}")
        if isinstance(node.op, ast.Pow) and power_bits(left, int(right)) > _MAX_POWER_BITS:
            raise ToolError(f"result has more than {MAX_RESULT_DIGITS} digits")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ToolError("division by zero")
        result = _BINARY[type(node.op)](left, right)
        result = Fraction(result)
        if max(len(str(abs(result.numerator))), len(str(result.denominator))) > MAX_RESULT_DIGITS:
            raise ToolError(f"result has more than {MAX_RESULT_DIGITS} digits")
        return result
    raise ToolError(f"'{ast.unparse(node)}' is not allowed; use numbers, + - * / // % ** and parentheses")


def format_number(value: Fraction, decimals: int = 6) -> str:
    """Integers exactly; other values as decimals with trailing zeros removed."""
    if value.denominator == 1:
        return str(value.numerator)
    text = f"{float(value):.{decimals}f}".rstrip("0").rstrip(".")
    return text if text not in ("", "-0") else "0"


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return the result.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(347+12)*86".
    """
    return format_number(evaluate_expression(expression))


@TOOLS.register("calculator")
def calculator_tool() -> Tool:
    return tool(calculator)
