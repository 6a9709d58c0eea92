"""Properties of the override parser and the seed list: any text gives a clean result or a ValueError that says
what was wrong, never another exception; a valid value lands in the config unchanged."""

import pytest
import typer
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from unipg.cli import parse_seeds
from unipg.config import ConfigError, load_config, parse_override
from unipg.config.loading import FLAT_ALIASES, schema_keys, set_dotted

LEAVES = sorted(key for key, section in schema_keys().items() if section is None)
VALID = schema_keys()  # dotted key → its section model, None for a value
KNOWN = set(VALID) | set(FLAT_ALIASES)

# Dotted-key-like text: mostly plausible names, sometimes any text at all.
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,10}", fullmatch=True)
keys = st.one_of(st.sampled_from(LEAVES), st.lists(names, min_size=1, max_size=3).map(".".join), st.text(max_size=20))
# Values that exercise the YAML parser: scalars, flow collections, tags, anchors, broken syntax.
yaml_bits = st.sampled_from(
    [
        "[",
        "]",
        "{",
        "}",
        ":",
        ": ",
        "-",
        "#",
        "!!",
        "!!float ",
        "!!int ",
        "!!bool ",
        "&a ",
        "*a",
        "'",
        '"',
        "|",
        ">",
        "\t",
        "\n",
        ",",
        "~",
        "null",
        "true",
        "no",
        "1e-3",
        ".inf",
    ]
)
values = st.one_of(st.text(max_size=30), st.lists(st.one_of(yaml_bits, st.text(max_size=4)), max_size=8).map("".join))


@settings(max_examples=150, deadline=None)
@given(text=st.one_of(st.text(max_size=40), st.builds(lambda key, value: f"{key}={value}", keys, values)))
def test_parse_override_gives_a_key_and_value_or_a_value_error(text):
    try:
        key, _ = parse_override(text)
    except ConfigError as error:  # a ValueError
        assert str(error).startswith(f"override '{text}' ")  # names the override, then what to write
        return
    assert key == key.strip() and key and all(part.strip() for part in key.split("."))
    assert key == text.partition("=")[0].strip()


@settings(max_examples=100, deadline=None)
@given(key=keys, value=values)
def test_load_config_with_any_override_builds_or_raises_a_config_error(key, value):
    try:
        load_config(None, [f"{key}={value}"])
    except ConfigError as error:
        assert str(error).strip()


@settings(max_examples=60, deadline=None)
@given(parts=st.lists(st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True), min_size=1, max_size=3))
def test_unknown_dotted_keys_are_rejected_naming_the_key(parts):
    prefixes = [".".join(parts[: i + 1]) for i in range(len(parts))]
    unknown = next((prefix for prefix in prefixes if prefix not in KNOWN), None)
    value_with_sub_keys = any(
        prefix in FLAT_ALIASES or (prefix in VALID and VALID[prefix] is None) for prefix in prefixes[:-1]
    )
    if unknown is None or value_with_sub_keys:  # a valid key, or sub-keys under a value: other properties
        return
    with pytest.raises(ConfigError, match=f"unknown key '{unknown}'"):
        load_config(None, [f"{'.'.join(parts)}=1"])


# Valid values of keys of each kind that no cross-field rule involves, and how the value is written on the
# command line. Text values exclude YAML's spellings of null (null, Null, ~), which mean None.
plain_text = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,15}", fullmatch=True).filter(
    lambda text: yaml.safe_load(text) is not None
)
ROUND_TRIP = {
    "seed": st.integers(0, 2**31 - 1),
    "eval.episodes": st.integers(1, 10**6),
    "sample.max_new_tokens": st.integers(1, 10**5),
    "sample.top_k": st.none() | st.integers(1, 1000),
    "train.learning_rate": st.floats(min_value=1e-12, max_value=10.0),
    "estimator.gamma": st.floats(min_value=0.0, max_value=1.0),
    "estimator.clip_range": st.floats(min_value=1e-6, max_value=0.999),
    "estimator.entropy_coef": st.floats(min_value=0.0, max_value=100.0),
    "train.max_grad_norm": st.none() | st.floats(min_value=1e-3, max_value=1e3),
    "learning_rate": st.floats(min_value=1e-9, max_value=1.0),  # a flat alias of train.learning_rate
    "estimator.normalize_advantages": st.booleans(),
    "log.tensorboard": st.booleans(),
    "env.id": plain_text,
    "log.run_name": plain_text,
    "device": st.sampled_from(["cpu", "auto"]),
    "model.dtype": st.sampled_from(["float32", "bfloat16", "float16"]),
    "runtime.schedule": st.sampled_from(["auto", "sequential", "concurrent"]),
    "policy.hidden_sizes": st.lists(st.integers(1, 512), min_size=1, max_size=4),
}


def written(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, float) else str(value)


@settings(max_examples=120, deadline=None)
@given(data=st.data(), key=st.sampled_from(sorted(ROUND_TRIP)))
def test_an_override_of_a_valid_value_lands_in_the_config_unchanged(data, key):
    value = data.draw(ROUND_TRIP[key], label="value")
    node = load_config(None, [f"{key}={written(value)}"])
    for part in FLAT_ALIASES.get(key, key).split("."):
        node = getattr(node, part)
    assert node == value and type(node) is type(value)


@settings(max_examples=50, deadline=None)
@given(path=st.lists(names, min_size=1, max_size=3), value=st.integers())
def test_set_dotted_places_the_value_at_the_dotted_path(path, value):
    tree: dict = {}
    set_dotted(tree, ".".join(path), value)
    for part in path[:-1]:
        tree = tree[part]
    assert tree == {path[-1]: value}


@settings(max_examples=120, deadline=None)
@given(
    text=st.one_of(
        st.text(max_size=20), st.lists(st.integers(-5, 50).map(str) | st.text(max_size=3), max_size=5).map(",".join)
    )
)
def test_parse_seeds_gives_integers_or_exits_with_code_2(text):
    try:
        seeds = parse_seeds(text)
    except typer.Exit as stop:
        assert stop.exit_code == 2
        return
    assert all(isinstance(seed, int) for seed in seeds) and len(set(seeds)) == len(seeds)


@settings(max_examples=100, deadline=None)
@given(seeds=st.lists(st.integers(0, 2**31 - 1), unique=True, max_size=6), spaces=st.sampled_from(["", " "]))
def test_parse_seeds_round_trips_a_list_of_distinct_seeds(seeds, spaces):
    assert parse_seeds(f",{spaces}".join(map(str, seeds))) == seeds
