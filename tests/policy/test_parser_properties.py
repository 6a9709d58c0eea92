"""Properties of the text parsers a policy's output goes through: tool calls, tool arguments, final answers.

Whatever a policy writes, the parsers answer (a kind, a problem, an answer or None) and never raise.
"""

import json
import typing
from fractions import Fraction

from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from unipg.envs import EnvironmentService
from unipg.envs.tool_env import parse_turn
from unipg.tasks.answers import extract_final_answer, normalize_answer
from unipg.tasks.rewards.rules import answers_equivalent
from unipg.tools import tool
from unipg.tools.base import CLOSE_TAG, OPEN_TAG, Tool, format_tool_call


@tool
def lookup(
    query: str,
    limit: int = 5,
    scale: float = 1.0,
    tags: list[str] | None = None,
    mode: typing.Literal["fast", "exact"] = "fast",
    verbose: bool = False,
    extra: dict | None = None,
) -> str:
    """Look something up."""
    return query


SERVICE = EnvironmentService({"lookup": lookup})

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
# Pieces that make text look like a call, so that generated turns reach every branch of the parser.
call_pieces = st.sampled_from(
    [
        OPEN_TAG,
        CLOSE_TAG,
        "{",
        "}",
        "[",
        "]",
        '"name"',
        '"arguments"',
        ": ",
        ", ",
        '"lookup"',
        '"query"',
        '"x"',
        "null",
        "1",
        "\\",
        '"',
        " ",
        "\n",
        "é",
        "🙂",
    ]
)
turns = st.lists(call_pieces | st.text(max_size=10), max_size=30).map("".join)


@settings(max_examples=150, deadline=None)
@given(text=st.text() | turns)
@example(text=OPEN_TAG + "[" * 100_000 + CLOSE_TAG)  # deeper than the interpreter's recursion limit
@example(text=OPEN_TAG + '{"name": ["lookup"]}' + CLOSE_TAG)  # an unhashable name
@example(text=OPEN_TAG + '{"name": "lookup", "arguments": {"limit": ' + "9" * 5000 + "}}" + CLOSE_TAG)
@example(text=OPEN_TAG + "9" * 4301 + CLOSE_TAG)  # past Python's int-string conversion limit
@example(text=OPEN_TAG + "-" + "1" * 10_000 + " trailing" + CLOSE_TAG)
@example(text=OPEN_TAG + '{"name": "lookup", "arguments": {"mode": ' + "[" * 900 + "]" * 900 + "}}" + CLOSE_TAG)
@example(text=OPEN_TAG + '{"a": ' * 50_000 + CLOSE_TAG)
def test_any_turn_is_an_answer_a_call_or_a_malformed_call_and_never_raises(text):
    turn = parse_turn(text, SERVICE)
    assert turn.kind in ("answer", "call", "malformed")
    assert (turn.kind == "answer") == (OPEN_TAG not in text)
    if turn.kind == "malformed":
        assert isinstance(turn.error, str) and turn.error
    if turn.kind == "call":
        assert turn.name == "lookup" and lookup.check_arguments(turn.arguments) is None


@settings(max_examples=100, deadline=None)
@given(
    name=st.text(min_size=1, max_size=20),
    arguments=st.dictionaries(st.text(max_size=10), json_values, max_size=4),
    before=st.text(max_size=20),
    after=st.text(max_size=20),
)
@example(name="python", arguments={"code": f"print('{CLOSE_TAG}')"}, before="", after="")
def test_a_formatted_call_parses_back_to_its_name_and_arguments(name, arguments, before, after):
    assume(OPEN_TAG not in before)
    anything = Tool(
        name,
        "accepts any arguments",
        {"type": "object", "properties": {key: {} for key in arguments}},
        lambda **kwargs: "",
    )
    turn = parse_turn(before + format_tool_call(name, arguments) + after, EnvironmentService({name: anything}))
    assert (turn.kind, turn.name, turn.arguments) == ("call", name, arguments)


adversarial_bodies = st.one_of(
    st.integers(4301, 20_000).map(lambda digits: "7" * digits),  # past the int-string conversion limit
    st.integers(4301, 6000).map(lambda digits: '{"name": "lookup", "arguments": {"limit": -%s}}' % ("1" * digits)),
    st.integers(1, 200_000).map(lambda depth: "[" * depth),  # nesting past the recursion limit
    st.integers(1, 50_000).map(lambda depth: '{"x": ' * depth),
    st.integers(500, 3000).map(
        lambda depth: '{"name": "lookup", "arguments": {"query": "q", "mode": ' + "[" * depth + "]" * depth + "}}"
    ),
    st.sampled_from(["NaN", "-Infinity", "1e999999", "[1e400]", '"\ud800"', '{"name": "\udfff"}', "\u0000"]),
)


@settings(max_examples=60, deadline=None)
@given(body=adversarial_bodies, before=st.text(max_size=5), after=st.sampled_from(["", CLOSE_TAG, " x " + CLOSE_TAG]))
def test_adversarial_json_in_a_call_is_a_malformed_call_and_never_raises(body, before, after):
    assume(OPEN_TAG not in before)
    turn = parse_turn(before + OPEN_TAG + body + CLOSE_TAG + after, SERVICE)
    assert turn.kind in ("call", "malformed")
    if turn.kind == "malformed":
        assert isinstance(turn.error, str) and turn.error


def test_an_integer_too_long_for_python_is_reported_as_such():
    turn = parse_turn(OPEN_TAG + '{"name": "lookup", "arguments": {"limit": ' + "9" * 5000 + "}}" + CLOSE_TAG, SERVICE)
    assert turn.kind == "malformed" and "too many digits" in turn.error


def test_unicode_nested_tags_missing_closing_tags_and_non_objects_are_malformed_with_a_reason():
    call = format_tool_call("lookup", {"query": "naïve café 東京 🙂"})
    assert parse_turn(call, SERVICE).arguments == {"query": "naïve café 東京 🙂"}
    cases = {
        OPEN_TAG + call: "not valid JSON",  # a call inside a call
        call.removesuffix(CLOSE_TAG): f"no closing {CLOSE_TAG}",
        f"{OPEN_TAG}[1, 2]{CLOSE_TAG}": '"name"',
        f"{OPEN_TAG}42{CLOSE_TAG}": '"name"',
        f"{OPEN_TAG}null{CLOSE_TAG}": '"name"',
        f'{OPEN_TAG}{{"name": 7}}{CLOSE_TAG}': '"name"',
        f"{OPEN_TAG}{'[' * 100_000}{CLOSE_TAG}": "nested too deeply",
        format_tool_call("lookup", None): "arguments must be a JSON object, got null",
        format_tool_call("lookup", {"query": 5}): "argument 'query' must be string, got integer",
        format_tool_call("lookup", {"query": "x", "mode": "slow"}): 'must be one of "fast", "exact"',
        format_tool_call("lookup", {"query": "x", "tags": ["a", 1]}): "array of string, got an element that is integer",
        format_tool_call("nope", {}): "unknown tool 'nope'; available: lookup",
    }
    for text, reason in cases.items():
        turn = parse_turn(text, SERVICE)
        assert turn.kind == "malformed" and reason in turn.error, (text[:80], turn.error)


@settings(max_examples=150, deadline=None)
@given(
    arguments=json_values
    | st.dictionaries(
        st.sampled_from(["query", "limit", "scale", "tags", "mode", "verbose", "extra", "other"]),
        json_values,
        max_size=5,
    )
)
def test_checking_any_json_arguments_gives_a_problem_or_none_and_never_raises(arguments):
    problem = lookup.check_arguments(arguments)
    assert problem is None or (isinstance(problem, str) and problem)
    if problem is None:  # then they fit the signature
        assert isinstance(arguments["query"], str) and set(arguments) <= set(lookup.parameters["properties"])


valid_lookup_arguments = st.fixed_dictionaries(
    {"query": st.text(max_size=10)},
    optional={
        "limit": st.integers(),
        "scale": st.integers() | st.floats(),
        "tags": st.lists(st.text(max_size=5)),
        "mode": st.sampled_from(["fast", "exact"]),
        "verbose": st.booleans(),
        "extra": st.dictionaries(st.text(max_size=5), json_values, max_size=2),
    },
)


@settings(max_examples=100, deadline=None)
@given(arguments=valid_lookup_arguments)
def test_arguments_that_fit_the_signature_pass_the_check(arguments):
    assert lookup.check_arguments(arguments) is None


@settings(max_examples=150, deadline=None)
@given(text=st.text())
@example(text="$ $5")
@example(text="5..")
@example(text="-$ $1,234. .")
def test_answer_extraction_and_normalisation_never_raise_and_normalising_is_idempotent(text):
    answer = extract_final_answer(text)
    assert answer is None or (isinstance(answer, str) and answer)
    normalized = normalize_answer(text)
    assert normalize_answer(normalized) == normalized


def decimal(digits: int, places: int) -> tuple[Fraction, str]:
    """digits / 10**places and how it is written: "-1,234.05" for (-123405, 2)."""
    whole, fraction = divmod(abs(digits), 10**places)
    return Fraction(digits, 10**places), f"{'-' if digits < 0 else ''}{whole:,}.{fraction:0{places}d}"


# A GSM8K answer as a fraction n/d, and how it is written: an integer (with thousands separators), a decimal,
# a negative, or a fraction p/q.
integers = st.integers(-(10**12), 10**12).map(lambda n: (Fraction(n), f"{n:,}"))
decimals = st.builds(decimal, st.integers(-(10**9), 10**9), st.integers(1, 6))
fractions = st.tuples(st.integers(-(10**6), 10**6), st.integers(1, 10**6)).map(
    lambda pair: (Fraction(pair[0], pair[1]), f"{pair[0]:,}/{pair[1]:,}")
)
gsm8k_numbers = integers | decimals | fractions
prose = st.text(st.characters(blacklist_characters="#0123456789-", blacklist_categories=("Cs",)), max_size=30)


@settings(max_examples=150, deadline=None)
@given(
    number=gsm8k_numbers,
    steps=prose,
    trailer=st.sampled_from(["", ".", "\n", " \nThanks!", ".\n\n"]),
    dollar=st.booleans(),
)
@example(number=(Fraction(-1234), "-1,234"), steps="", trailer=".", dollar=True)
def test_the_answer_after_the_last_marker_is_the_number_written_there(number, steps, trailer, dollar):
    value, written = number
    if dollar:  # "$5", and for a negative amount both "$-5" and "-$5"
        written = f"-${written[1:]}" if written.startswith("-") and len(steps) % 2 else f"${written}"
    text = f"{steps}\nSo the total is 3 + 4 = <<3+4=7>>7.\n#### {written}{trailer}"
    assert Fraction(extract_final_answer(text)) == value
    assert answers_equivalent(extract_final_answer(text), str(value))


@settings(max_examples=150, deadline=None)
@given(number=gsm8k_numbers, steps=prose, end=st.sampled_from(["", ".", " in all.", "!", " apples\n"]))
def test_without_a_marker_the_last_number_in_the_text_is_the_answer(number, steps, end):
    value, written = number
    text = f"First 12 and 3.5, then{steps} the answer is {written}{end}"
    assert Fraction(extract_final_answer(text)) == value


answer_texts = st.text(st.sampled_from("0123456789.,-+*/()$ x^\\{}frac sqrtpi"), max_size=12) | gsm8k_numbers.map(
    lambda number: number[1]
)


@settings(max_examples=80, deadline=None)
@given(first=answer_texts, second=answer_texts)
@example(first="1/2", second="0.5")
@example(first="1,000", second="1000")
def test_answer_equivalence_is_reflexive_and_symmetric_and_never_raises(first, second):
    assert answers_equivalent(first, first)
    assert answers_equivalent(first, second) == answers_equivalent(second, first)


def test_json_round_trip_of_a_call_keeps_every_json_type():
    arguments = {
        "none": None,
        "flag": True,
        "count": -3,
        "ratio": 0.25,
        "text": 'a"b\\c',
        "list": [1, [2]],
        "object": {"k": {}},
    }
    anything = Tool("t", "", {"type": "object", "properties": {key: {} for key in arguments}}, lambda **kw: "")
    turn = parse_turn(format_tool_call("t", arguments), EnvironmentService({"t": anything}))
    assert turn.arguments == arguments == json.loads(json.dumps(arguments))
