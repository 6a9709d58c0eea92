"""Building a ``Config``: a YAML file plus dotted command-line overrides.

A config is built in four steps, each of which can reject it with a message that says what to fix:

1. the YAML file and the overrides (``estimator.clip_range=0.1``) are merged into one nested dict; the flat
   keys of seed 000's reference configuration (``learning_rate``, ``clip_range``, ...) are moved to their
   structured place;
2. every key is checked against the schema; an unknown key names the nearest valid one;
3. the algorithm preset fills the keys the user did not set;
4. field types and ranges, then cross-field rules, are validated.

A key that the chosen algorithm does not use is reported as a warning (``Config.warnings``), so no key is
ever a silent no-op.
"""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from unipg.config import Config, ConfigError
from unipg.presets import ALGORITHMS, algorithm_names, ignored_keys


# Seed 000 section 6.2 uses flat keys; each maps onto one structured key.
FLAT_ALIASES: dict[str, str] = {
    "learning_rate": "train.learning_rate",
    "clip_range": "estimator.clip_range",
    "kl_coef": "estimator.kl_coef",
    "entropy_coef": "estimator.entropy_coef",
    "gamma": "estimator.gamma",
    "lambda_gae": "estimator.lambda_gae",
    "batch_size": "train.batch_size",
    "mini_batch_size": "train.mini_batch_size",
    "rollout_steps": "sample.rollout_steps",
    "replay_buffer_size": "sample.replay_buffer_size",
    "sample_age_decay": "estimator.sample_age_decay",
    "num_epochs": "train.num_epochs",
    "max_grad_norm": "train.max_grad_norm",
    "value_loss_coef": "estimator.value_loss_coef",
    "target_kl": "estimator.target_kl",
}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Build a validated Config from an optional YAML file and ``key=value`` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_yaml(Path(path))
    for override in overrides or []:
        key, value = parse_override(override)
        set_dotted(raw, key, value)
    return build_config(raw)


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist; pass the path of a YAML file")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise ConfigError(f"config file '{path}' is not valid YAML: {error}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file '{path}' is not UTF-8 text; save it as UTF-8") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of keys to values, got {type(data).__name__}")
    return data


def parse_override(text: str) -> tuple[str, Any]:
    """``estimator.clip_range=0.1`` → ("estimator.clip_range", 0.1); values are parsed as YAML scalars."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override '{text}' must look like key=value, e.g. estimator.clip_range=0.1")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        parsed = value
    return key.strip(), parsed


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set '{dotted}': '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def build_config(raw: dict[str, Any]) -> Config:
    tree = apply_flat_aliases(copy.deepcopy(raw))
    check_known_keys(tree)
    user_keys = flatten_keys(tree)
    algorithm = tree.get("algorithm", Config.model_fields["algorithm"].default)
    if algorithm not in ALGORITHMS:
        close = difflib.get_close_matches(str(algorithm), algorithm_names(), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"unknown algorithm '{algorithm}'{hint} Valid: {', '.join(algorithm_names())}")
    text = isinstance(tree.get("task"), dict) and tree["task"].get("name") is not None
    try:
        preset = ALGORITHMS[algorithm].preset_for(text)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    merged = deep_merge(copy.deepcopy(preset), tree)
    try:
        config = Config.model_validate(merged)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error)) from None
    from unipg.config_rules import cross_field_problems  # the rules read Config; imported late to avoid a cycle

    problems = cross_field_problems(config)
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))
    config.warnings = ignored_keys(config, user_keys)
    return config


def apply_flat_aliases(tree: dict[str, Any]) -> dict[str, Any]:
    for flat, dotted in FLAT_ALIASES.items():
        if flat not in tree:
            continue
        section, name = dotted.split(".")
        if isinstance(tree.get(section), dict) and name in tree[section]:
            raise ConfigError(f"'{flat}' and '{dotted}' are both set; keep one of them")
        set_dotted(tree, dotted, tree.pop(flat))
    return tree


def schema_keys(model: type[BaseModel] = Config, prefix: str = "") -> dict[str, type[BaseModel] | None]:
    """Every valid dotted key → its section model (None for leaves)."""
    keys: dict[str, type[BaseModel] | None] = {}
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys[prefix + name] = annotation
            keys.update(schema_keys(annotation, prefix + name + "."))
        else:
            keys[prefix + name] = None
    return keys


def check_known_keys(tree: dict[str, Any]) -> None:
    valid = schema_keys()
    structured = [key for key, section in valid.items() if section is None]
    problems = []
    for key, value in iter_items(tree):
        if key in valid:
            if valid[key] is not None and not isinstance(value, dict):
                problems.append(f"'{key}' is a section; give it a mapping such as {key}: {{...}}")
            continue
        leaves = structured if "." in key else structured + list(FLAT_ALIASES)
        close = difflib.get_close_matches(key, leaves, n=1, cutoff=0.6)
        if not close:  # a misspelt leaf under the right section, or the right leaf under the wrong one
            tail = key.rsplit(".", 1)[-1]
            close = [leaf for leaf in leaves if leaf.rsplit(".", 1)[-1] == tail][:1]
        hint = f"; did you mean '{close[0]}'?" if close else ""
        problems.append(f"unknown key '{key}'{hint}")
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))


def iter_items(tree: dict[str, Any], prefix: str = ""):
    """(dotted key, value) pairs, descending into sections the schema knows."""
    valid = schema_keys()
    for name, value in tree.items():
        key = prefix + str(name)
        yield key, value
        if isinstance(value, dict) and valid.get(key) is not None:
            yield from iter_items(value, key + ".")


def flatten_keys(tree: dict[str, Any], prefix: str = "") -> set[str]:
    keys = set()
    for name, value in tree.items():
        key = prefix + str(name)
        if isinstance(value, dict):
            keys |= flatten_keys(value, key + ".")
        else:
            keys.add(key)
    return keys


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            deep_merge(base[key], value)
        else:
            base[key] = value
    return base


def format_validation_error(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"])
        lines.append(f"'{key}': {item['msg']} (got {item.get('input')!r})")
    return "invalid configuration:\n  - " + "\n  - ".join(lines)
