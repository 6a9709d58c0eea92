import asyncio
import typing

import pytest

from unipg.tools import TOOLS, LatencyModel, ToolError, tool
from unipg.tools.calculator import calculator


def test_schema_comes_from_the_signature_and_docstring():
    @tool
    def lookup(query: str, limit: int = 3, exact: bool | None = None) -> str:
        """Find documents.

        Args:
            query: words to look for,
                over several lines.
            limit: how many results.
        """
        return query

    schema = lookup.schema()["function"]
    assert schema["name"] == "lookup" and schema["description"] == "Find documents."
    properties = schema["parameters"]["properties"]
    assert properties["query"] == {"type": "string", "description": "words to look for, over several lines."}
    assert properties["limit"]["type"] == "integer" and properties["exact"] == {"type": "boolean", "nullable": True}
    assert schema["parameters"]["required"] == ["query"]
    assert lookup.check_arguments({"query": "x"}) is None
    assert "missing" in lookup.check_arguments({})
    assert "unknown argument" in lookup.check_arguments({"query": "x", "colour": 1})
    assert "must be integer" in lookup.check_arguments({"query": "x", "limit": "3"})
    assert lookup.check_arguments({"query": "x", "exact": None}) is None  # Optional: null is accepted


def test_the_schema_is_the_one_transformers_builds_for_chat_templates():
    from transformers.utils import get_json_schema

    def convert(amount: float, unit: typing.Literal["km", "mi"] = "km", tags: list[str] | None = None) -> str:
        """Convert a distance.

        Args:
            amount: the distance.
            unit: the unit to convert to.
            tags: labels to keep.
        """
        return ""

    expected = get_json_schema(convert)
    assert tool(convert).schema() == {
        "type": "function",
        "function": {key: expected["function"][key] for key in ("name", "description", "parameters")},
    }
    assert expected["function"]["parameters"]["properties"]["unit"]["enum"] == ["km", "mi"]


def test_parameters_without_a_type_are_rejected_at_definition():
    with pytest.raises(TypeError, match="tool parameters must be annotated.*missing a type hint"):

        @tool
        def bad(value) -> str:
            return ""


def test_arguments_without_a_description_are_accepted_without_one():
    @tool
    def echo(text: str, times: int = 1) -> str:
        """Repeat the text."""
        return text * times

    assert echo.description == "Repeat the text."
    assert echo.parameters["properties"] == {"text": {"type": "string"}, "times": {"type": "integer"}}
    assert echo.required == ["text"]


@pytest.mark.parametrize(
    "expression, result",
    [
        ("4738*29", "137402"),
        ("7/3", "2.333333"),
        ("-(3+4)*2", "-14"),
        ("2**10", "1024"),
        ("1e3+1", "1001"),
        ("10//3 + 10%3", "4"),
    ],
)
def test_calculator_is_exact(expression, result):
    assert calculator(expression) == result


@pytest.mark.parametrize(
    "expression, problem",
    [
        ("9**9**9", "exponents"),
        ("__import__('os')", "not allowed"),
        ("1/0", "division by zero"),
        ("2+", "cannot parse"),
        ("x*2", "not allowed"),
        ("1" * 300, "longer than"),
    ],
)
def test_calculator_refuses_what_it_cannot_do_safely(expression, problem):
    with pytest.raises(ToolError, match=problem):
        calculator(expression)


def test_built_in_tools_are_registered():
    assert {"calculator", "python", "search"} <= set(TOOLS.names())
    assert TOOLS.get("calculator")().schema()["function"]["parameters"]["required"] == ["expression"]


def test_latency_models_draw_as_declared():
    import random

    rng = random.Random(0)
    assert LatencyModel("fixed", 0.25).draw(rng) == 0.25
    lognormal = sorted(LatencyModel("lognormal", 0.1, sigma=0.5).draw(rng) for _ in range(2001))
    assert 0.09 < lognormal[1000] < 0.11  # the median is `seconds`
    pareto = [LatencyModel("pareto", 0.1, alpha=1.5).draw(rng) for _ in range(2000)]
    assert min(pareto) >= 0.1 and max(pareto) > 2.0  # heavy tail: a few calls take many times the typical
    with pytest.raises(ValueError, match="latency kind"):
        LatencyModel("uniform", 1.0)
    assert asyncio.iscoroutinefunction(TOOLS.get("python")().function)
