"""Building a ``Config``: a YAML file plus dotted command-line overrides.

A config is built in four steps, each of which can reject it with a message that says what to fix:

1. the YAML file (read by ``unipg.config.yaml_file``) and the overrides (``estimator.clip_range=0.1``) are merged
   into one nested dict; the flat keys of seed 000's reference configuration (``learning_rate``, ``clip_range``,
   ...) are moved to their structured place;
2. every key is checked against the schema; an unknown key names the nearest valid one;
3. the algorithm preset fills the keys the user did not set;
4. field types and ranges, then cross-field rules, are validated.

A key that the chosen algorithm does not use is reported as a warning (``Config.warnings``), so no key is
ever a silent no-op.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from unipg.config.hyperparameters import accepted_phrase, chosen_estimators
from unipg.config.plugins import import_plugins, resolve_plugins
from unipg.config.presets import ALGORITHMS, algorithm_names, ignored_keys
from unipg.config.rules import cross_field_problems, decisions_on_test_split
from unipg.config.schema import Config
from unipg.config.secrets import drop_redacted
from unipg.config.section import ConfigError, is_text_field
from unipg.config.specs import reward_specs
from unipg.config.yaml_file import read_yaml, refers_to_itself

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
    "dtype": "model.dtype",  # beside the top-level device
}


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    unread: tuple[str, ...] = (),
    plugins: list[str] | None = None,
    edit: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Config:
    """Build a validated Config from an optional YAML file and ``key=value`` overrides. Secrets the file holds
    redacted (a run's config.yaml) are read again from overrides or the environment, except in the top-level
    sections named in ``unread``, which the caller never reads: there they are left out. ``plugins`` are added
    to the config's own (``unipg --import``); file plugins of the YAML file are relative to its folder, those of
    overrides to the working directory. ``edit`` changes the file's tree before the overrides apply (a run folder's
    code is left out: ``unipg.config.run_folder``)."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_yaml(Path(path))
        if edit is not None:
            raw = edit(raw)
        for section in unread:
            if section in raw:
                raw[section] = drop_redacted(raw[section])
        if "plugins" in raw:
            raw["plugins"] = resolve_plugins(raw["plugins"], Path(path).parent)
    for override in overrides or []:
        key, value = parse_override(override)
        set_dotted(raw, key, value)
    return build_config(with_plugins(raw, plugins))


def with_plugins(raw: dict[str, Any], extra: list[str] | None) -> dict[str, Any]:
    """``raw`` with its plugins resolved (relative files from the working directory) and ``extra`` appended."""
    if "plugins" not in raw and not extra:
        return raw
    resolved = resolve_plugins(raw.get("plugins"), Path.cwd())
    raw["plugins"] = resolved + [
        plugin for plugin in resolve_plugins(extra, Path.cwd(), "--import") if plugin not in resolved
    ]
    return raw


def parse_override(text: str) -> tuple[str, Any]:
    """``estimator.clip_range=0.1`` → ("estimator.clip_range", 0.1); values are parsed as YAML scalars.

    A value YAML cannot parse is kept as the text written, and so is any value of a text field (``model.name=no``
    is the name 'no', not the boolean false; ``log.run_name=2024-01-01`` is not a date); ``null`` stays None.
    """
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override '{text}' must look like key=value, e.g. estimator.clip_range=0.1")
    if any(not part.strip() for part in key.split(".")):
        raise ConfigError(
            f"override '{text}' has an empty part in its key '{key}'; write section.name=value, "
            "e.g. estimator.clip_range=0.1"
        )
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except Exception:  # `[a`, `!!float x`, `[[[[...`: PyYAML raises YAMLError and whatever its constructors hit
        parsed = value.strip()
    if refers_to_itself(parsed):
        raise ConfigError(f"override '{text}' holds a YAML alias inside the value it names; write the value out")
    if parsed is not None and not isinstance(parsed, str) and is_text_field(leaf_annotation(key)):
        parsed = value.strip()
    return key, parsed


def leaf_annotation(dotted: str) -> Any:
    """The annotation of the schema field at ``dotted`` (a flat alias is resolved first), or None if none."""
    *sections, leaf = FLAT_ALIASES.get(dotted, dotted).split(".")
    model: type[BaseModel] = Config
    for name in sections:
        field = model.model_fields.get(name)
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return None
        model = field.annotation
    field = model.model_fields.get(leaf)
    return None if field is None or field.exclude else field.annotation


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
    """A validated Config from a nested dict, after importing the plugins it names (``unipg.config.plugins``)."""
    if "plugins" in raw:
        raw = {**raw, "plugins": resolve_plugins(raw["plugins"], Path.cwd())}
    import_plugins(raw.get("plugins", []))
    tree = apply_flat_aliases(copy.deepcopy(raw))
    check_known_keys(tree)
    reshaped = []
    if isinstance(tree.get("task"), dict) and "rewards" in tree["task"]:
        try:
            tree["task"]["rewards"], reshaped = reward_specs(tree["task"]["rewards"])
        except ValueError as error:
            raise ConfigError(invalid_configuration([str(error)])) from None
    user_keys = flatten_keys(tree)
    algorithm = tree.get("algorithm", Config.model_fields["algorithm"].default)
    if not isinstance(algorithm, str):
        raise ConfigError(
            f"algorithm must be the name of a preset, got {algorithm!r}. Valid: {', '.join(algorithm_names())}"
        )
    if algorithm not in ALGORITHMS:
        close = difflib.get_close_matches(str(algorithm), algorithm_names(), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else "."
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
    renamed = [] if text else read_gym_batch_keys(config, user_keys)
    problems = cross_field_problems(config)
    if problems:
        raise ConfigError(invalid_configuration(problems))
    config.warnings = reshaped + renamed + ignored_keys(config, user_keys) + decisions_on_test_split(config)
    return config


# Batch sizes carry their unit: completions in language-model runs, environment transitions in gymnasium runs.
GYM_BATCH_KEYS = {"batch_size": "batch_transitions", "mini_batch_size": "mini_batch_transitions"}


def read_gym_batch_keys(config: Config, user_keys: set[str]) -> list[str]:
    """In a gymnasium run, read ``train.batch_size`` and ``train.mini_batch_size`` as ``train.batch_transitions``
    and ``train.mini_batch_transitions`` where only the old name is set (the names before batch sizes carried
    their unit, and those of seed 000's reference config); returns a deprecation warning for each, and renames
    the key in ``user_keys``."""
    warnings = []
    for old, new in GYM_BATCH_KEYS.items():
        if f"train.{old}" in user_keys and f"train.{new}" not in user_keys:
            value = getattr(config.train, old)
            setattr(config.train, new, value)
            user_keys.discard(f"train.{old}")
            user_keys.add(f"train.{new}")
            warnings.append(
                f"'train.{old}' counts completions in language-model runs; a gymnasium run counts its "
                f"batch in environment transitions: read as 'train.{new}' ({value}); rename the key"
            )
    return warnings


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
        hint = f"; did you mean '{close[0]}'?" if close else f"; {siblings(key, valid)}."
        if key.startswith("estimator.") or FLAT_ALIASES.get(close[0] if close else "", "").startswith("estimator."):
            hint += " " + accepted_phrase(chosen_in(tree))
        problems.append(f"unknown key '{key}'{hint}")
    if problems:
        raise ConfigError(invalid_configuration(problems))


def chosen_in(tree: dict[str, Any]) -> dict[str, str]:
    """The estimators a raw config tree chooses: its own estimator section over its algorithm's preset (the
    defaults where the algorithm is unknown or the values are not names)."""
    algorithm = (
        ALGORITHMS.get(tree.get("algorithm", Config.model_fields["algorithm"].default))
        if isinstance(tree.get("algorithm", ""), str)
        else None
    )
    text = isinstance(tree.get("task"), dict) and tree["task"].get("name") is not None
    preset = {}
    if algorithm is not None and (algorithm.lm_preset if text else algorithm.preset) is not None:
        preset = dict(algorithm.preset_for(text).get("estimator", {}))
    section = tree.get("estimator")
    return chosen_estimators({**preset, **(section if isinstance(section, dict) else {})})


def siblings(key: str, valid: dict[str, type[BaseModel] | None]) -> str:
    """The valid keys of the section ``key`` sits in (the top level for an undotted key), as a phrase."""
    prefix = key.rsplit(".", 1)[0] + "." if "." in key else ""
    names = sorted(name[len(prefix) :] for name in valid if name.startswith(prefix) and "." not in name[len(prefix) :])
    where = f"section '{prefix[:-1]}' has" if prefix else "valid top-level keys:"
    return f"{where} {', '.join(names)}"


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
        message = item["msg"].removeprefix("Value error, ")  # our own validators' messages need no prefix
        lines.append(f"'{key}': {message} (got {item.get('input')!r})")
    return invalid_configuration(lines)


def invalid_configuration(problems: list[str]) -> str:
    """One problem on one line; several as a list, one per line."""
    if len(problems) == 1:
        return f"invalid configuration: {problems[0]}"
    return "invalid configuration:\n  - " + "\n  - ".join(problems)
