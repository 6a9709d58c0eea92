"""Reading a config's YAML file: a mapping of keys to values, each failure (a folder, not UTF-8, not YAML, a key
set twice, an alias inside itself) named with what to do about it."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import yaml

from unipg.config.section import ConfigError


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that rejects a key set twice in one mapping (plain YAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        lines: dict[str, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            line = key_node.start_mark.line + 1
            if key_node.value in lines:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key '{key_node.value}' is set twice (lines {lines[key_node.value]} and {line}); keep one of them",
                    key_node.start_mark,
                )
            lines[key_node.value] = line
        return super().construct_mapping(node, deep)


def read_yaml(path: Path) -> dict[str, Any]:
    if path.is_dir():
        example = f" such as '{path / 'config.yaml'}'" if (path / "config.yaml").is_file() else ""
        raise ConfigError(f"config file '{path}' is a folder; pass the path of a YAML file{example}")
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist; pass the path of a YAML file")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw[: error.start].count(b"\n") + 1
        raise ConfigError(
            f"config file '{path}' is not UTF-8 text (byte {raw[error.start]:#04x} on line {line}); save it as UTF-8"
        ) from None
    try:
        data = yaml.load(text, Loader=UniqueKeyLoader)
    except yaml.YAMLError as error:
        raise ConfigError(f"config file '{path}' is not valid YAML: {describe_yaml_error(error)}") from None
    except Exception as error:  # PyYAML's constructors raise what they hit: `!!float abc`, `!!float`, deep nesting
        raise ConfigError(
            f"config file '{path}' holds a value YAML cannot build ({type(error).__name__}: "
            f"{error}); quote the value or remove its explicit !!tag"
        ) from None
    if refers_to_itself(data):
        raise ConfigError(
            f"config file '{path}' holds a YAML alias inside the value it names (&name ... *name); "
            "write the value out instead"
        )
    if data is None:  # empty, or only comments: the defaults, as with no file
        warnings.warn(f"config file '{path}' holds no settings; training with the defaults", stacklevel=3)
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file '{path}' must hold a mapping of keys to values (key: value lines), got "
            f"a {type(data).__name__}"
        )
    return data


def refers_to_itself(node: Any, enclosing: frozenset[int] = frozenset()) -> bool:
    """Whether a loaded YAML value contains itself (``&a [*a]``), which no setting can hold."""
    if not isinstance(node, (dict, list)):
        return False
    if id(node) in enclosing:
        return True
    children = node.values() if isinstance(node, dict) else node
    return any(refers_to_itself(child, enclosing | {id(node)}) for child in children)


def describe_yaml_error(error: yaml.YAMLError) -> str:
    """One line: where the parser stopped, what it found, and a hint for the common slips (tabs, brackets)."""
    if not isinstance(error, yaml.MarkedYAMLError) or error.problem_mark is None:
        return " ".join(str(error).split())
    mark = error.problem_mark
    message = f"line {mark.line + 1}, column {mark.column + 1}: {error.problem}"
    if error.context and error.context_mark is not None:
        opened = error.context_mark
        message += f" ({error.context} that starts on line {opened.line + 1}, column {opened.column + 1})"
    if "'\\t'" in str(error.problem):
        message += "; indent with spaces, YAML does not allow tabs"
    elif error.context and "flow" in error.context:
        message += "; close the bracket or brace opened there"
    return message
