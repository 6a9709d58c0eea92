"""A unit-conversion tool: ``convert(value, from_unit, to_unit)``, exact, over a small closed vocabulary of units.

Units are words from ``UNITS``; the tool's schema lists them (``enum``), so a call with a unit outside the
vocabulary is a malformed call the agent is told about, and a conversion between different quantities (km to
kg) is refused with a ``ToolError``. Factors are exact (1 in = 25.4 mm, 1 lb = 453.59237 g, by definition), and
the value is converted with ``Fraction``s, so 347 km in m is exactly 347000.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Literal

from unipg.tools.base import TOOLS, Tool, ToolError, tool
from unipg.tools.calculator import format_number

UNITS: dict[str, tuple[str, Fraction]] = {
    # unit: (quantity, size in the quantity's base unit: mm, mg, s, ml)
    "km": ("length", Fraction(1_000_000)),
    "m": ("length", Fraction(1000)),
    "cm": ("length", Fraction(10)),
    "mm": ("length", Fraction(1)),
    "yd": ("length", Fraction("914.4")),
    "ft": ("length", Fraction("304.8")),
    "in": ("length", Fraction("25.4")),
    "kg": ("mass", Fraction(1_000_000)),
    "g": ("mass", Fraction(1000)),
    "mg": ("mass", Fraction(1)),
    "lb": ("mass", Fraction("453592.37")),
    "oz": ("mass", Fraction("28349.523125")),
    "week": ("time", Fraction(604_800)),
    "day": ("time", Fraction(86_400)),
    "h": ("time", Fraction(3600)),
    "min": ("time", Fraction(60)),
    "s": ("time", Fraction(1)),
    "l": ("volume", Fraction(1000)),
    "ml": ("volume", Fraction(1)),
}
Unit = Literal[
    "km", "m", "cm", "mm", "yd", "ft", "in", "kg", "g", "mg", "lb", "oz", "week", "day", "h", "min", "s", "l", "ml"
]
MAX_VALUE = 10**12  # a larger magnitude is no unit conversion a task asks for


def convert_value(value: float, from_unit: str, to_unit: str) -> Fraction:
    """``value`` ``from_unit`` expressed in ``to_unit``, exactly; ToolError for different quantities."""
    if not math.isfinite(value) or abs(value) > MAX_VALUE:
        raise ToolError(f"value {value} is out of range (at most {MAX_VALUE:.0e} in magnitude)")
    (quantity, size), (other, target) = UNITS[from_unit], UNITS[to_unit]
    if quantity != other:
        raise ToolError(f"cannot convert {quantity} ({from_unit}) to {other} ({to_unit})")
    return Fraction(str(value)) * size / target


def convert(value: float, from_unit: Unit, to_unit: Unit) -> str:
    """Convert a quantity from one unit to another and return the number.

    Args:
        value: the number to convert, e.g. 347.
        from_unit: the unit of the value, e.g. "km".
        to_unit: the unit to express it in, e.g. "m".
    """
    return format_number(convert_value(value, from_unit, to_unit))


@TOOLS.register("convert")
def convert_tool() -> Tool:
    return tool(convert)
