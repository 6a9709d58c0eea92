"""The configuration reference, read from the schema: every key's type, default, help (the docstring under its
field), the modes that read it, the values the algorithm presets give it, and the estimators or algorithms that
ignore it.

``unipg config --explain [KEY|SECTION]`` prints it in a terminal (``unipg.config.explain``);
``python -m unipg.config.reference > docs/config.md`` writes it as Markdown, and a test fails when the
committed file differs from what this module prints.
"""

from __future__ import annotations

import inspect
import re
import types
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from unipg.config.hyperparameters import governed
from unipg.config.presets import ALGORITHMS
from unipg.config.schema import Config
from unipg.config.section import MODES, field_modes

REGENERATE = "python -m unipg.config.reference > docs/config.md"


@dataclass(frozen=True)
class KeyDoc:
    """One key of the reference; every text is plain, one paragraph."""

    key: str  # dotted; items of a list are key[].field, entries of a mapping key.<name>.field
    type: str  # e.g. "float | null (> 0)"
    default: str  # as YAML writes it, or "required"
    help: str
    modes: tuple[str, ...]  # the modes whose runs read it (a subset of MODES)
    condition: str = ""  # e.g. "only when estimator.policy_loss is ppo or decoupled_ppo"
    presets: str = ""  # e.g. "0.2: ppo (gym), grpo; 0.28: dapo"
    ignored_by: str = ""  # algorithms that never read it in a mode that does, e.g. "trpo"


@dataclass(frozen=True)
class SectionDoc:
    name: str  # "" for the top-level keys
    help: str
    modes: tuple[str, ...]
    keys: list[KeyDoc]


def sections() -> list[SectionDoc]:
    """The top-level keys, then every section in the order of ``Config``."""
    top = [
        field_doc(name, field, (field,))
        for name, field in Config.model_fields.items()
        if not field.exclude and not is_model(field.annotation)
    ]
    found = [SectionDoc("", "Keys at the top level of a config file.", MODES, top)]
    for name, field in Config.model_fields.items():
        if field.exclude or not is_model(field.annotation):
            continue
        keys = field_docs(field.annotation, f"{name}.", (field,))
        found.append(SectionDoc(name, paragraph(field.annotation.__doc__), field_modes(field), keys))
    return found


def field_docs(model: type[BaseModel], prefix: str, path: tuple[FieldInfo, ...]) -> list[KeyDoc]:
    """The keys of ``model`` under ``prefix``, each followed by the keys of the mappings it holds."""
    docs = []
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        docs.append(field_doc(prefix + name, field, path + (field,)))
        for inner_prefix, inner in nested_models(prefix + name, field.annotation):
            docs += field_docs(inner, inner_prefix, path + (field,))
    return docs


def nested_models(key: str, annotation: Any) -> list[tuple[str, type[BaseModel]]]:
    """(prefix, model) of each mapping with a schema of its own that a field holds: ``data.offline`` → its
    fields under ``data.offline.``; a list of them under ``key[].``, a mapping of them under ``key.<name>.``."""
    if is_model(annotation):
        return [(f"{key}.", annotation)]
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType):
        return [found for arg in args for found in nested_models(key, arg)]
    if origin is list and args and is_model(args[0]):
        return [(f"{key}[].", args[0])]
    if origin is dict and len(args) == 2 and is_model(args[1]):
        return [(f"{key}.<name>.", args[1])]
    return []


def field_doc(key: str, field: FieldInfo, path: tuple[FieldInfo, ...]) -> KeyDoc:
    modes = tuple(mode for mode in MODES if all(mode in field_modes(step) for step in path))
    return KeyDoc(
        key=key,
        type=type_text(field),
        default=default_text(field),
        help=paragraph(field.description),
        modes=modes,
        condition=condition_text(key),
        presets=preset_text(key),
        ignored_by=ignored_by_text(key, modes),
    )


def is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def paragraph(text: str | None) -> str:
    """A docstring as one paragraph: hand-wrapped lines joined, ``code`` written `code`."""
    return " ".join(inspect.cleandoc(text or "").split()).replace("``", "`")


def annotation_text(annotation: Any) -> str:
    """``float | None`` → "float | null", ``Literal["a", "b"]`` → "'a' | 'b'", a section → "mapping"."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:  # one member of a union bounded on its own: "int (≥ 1) | 'auto' | null"
        bounds = bounds_text(args[1:])
        return f"{annotation_text(args[0])} ({bounds})" if bounds else annotation_text(args[0])
    if origin in (Union, types.UnionType):
        return " | ".join(annotation_text(arg) for arg in args)
    if origin is Literal:
        return " | ".join(repr(arg) for arg in args)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(annotation_text(arg) for arg in args)}]"
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any"
    if is_model(annotation):
        return "mapping"
    return getattr(annotation, "__name__", str(annotation))


BOUNDS = (
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Ge, "ge", "≥"),
    (annotated_types.Lt, "lt", "<"),
    (annotated_types.Le, "le", "≤"),
)


def bounds_text(metadata) -> str:
    """The bounds among a field's metadata (a FieldInfo inside ``Annotated`` holds its own): "> 0, < 1"."""
    items = [inner for item in metadata for inner in (item.metadata if isinstance(item, FieldInfo) else [item])]
    return ", ".join(
        f"{sign} {value_text(getattr(item, attribute))}"
        for item in items
        for kind, attribute, sign in BOUNDS
        if isinstance(item, kind)
    )


def type_text(field: FieldInfo) -> str:
    """The field's type and its bounds: "float (> 0, < 1)"."""
    bounds = bounds_text(field.metadata)
    text = annotation_text(field.annotation)
    return f"{text} ({bounds})" if bounds else text


def value_text(value: Any) -> str:
    """A value as a config file writes it: null, true, 0.2, 1e-05, token-mean, [64, 64], {}."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        plain = re.fullmatch(r"[A-Za-z_][\w./@:+-]*", value) and value.lower() not in (
            "null",
            "true",
            "false",
            "yes",
            "no",
            "on",
            "off",
        )
        return value if plain else repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(value_text(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {value_text(item)}" for key, item in value.items()) + "}"
    return str(value)


def default_text(field: FieldInfo) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    return value_text(field.get_default(call_default_factory=True))


def condition_text(key: str) -> str:
    """For an estimator hyperparameter that only some estimators read, which choice reads it."""
    section, _, name = key.partition(".")
    readers = governed().get(name) if section == "estimator" else None
    if readers is None:
        return ""
    choice, names = readers
    return f"only when estimator.{choice.selector} is {' or '.join(names)}"


def algorithm_label(name: str, text: bool) -> str:
    """ "grpo"; "ppo (lm)" for an algorithm with presets in both modes."""
    algorithm = ALGORITHMS[name]
    both = algorithm.preset is not None and algorithm.lm_preset is not None
    return f"{name} ({'lm' if text else 'gym'})" if both else name


def algorithm_modes() -> list[tuple[str, bool]]:
    """(algorithm, text) for every preset, gymnasium presets first."""
    return [
        (name, text)
        for text in (False, True)
        for name, algorithm in ALGORITHMS.items()
        if (algorithm.lm_preset if text else algorithm.preset) is not None
    ]


def preset_text(key: str) -> str:
    """The values the presets give a ``section.name`` or top-level key: "0.2: ppo (gym), grpo; 0.28: dapo"."""
    parts = key.split(".")
    if len(parts) > 2:
        return ""
    by_value: dict[str, list[str]] = {}
    for name, text in algorithm_modes():
        values = ALGORITHMS[name].preset_for(text)
        values = values.get(parts[0], {}) if len(parts) == 2 else values
        if isinstance(values, dict) and parts[-1] in values:
            by_value.setdefault(value_text(values[parts[-1]]), []).append(algorithm_label(name, text))
    return "; ".join(f"{value}: {', '.join(names)}" for value, names in by_value.items())


def ignored_by_text(key: str, modes: tuple[str, ...]) -> str:
    """The algorithms that do not read a key in a mode that otherwise does (TRPO and ``train.num_epochs``)."""
    if "[]" in key or "<" in key:
        return ""
    return ", ".join(
        algorithm_label(name, text)
        for name, text in algorithm_modes()
        if ("lm" if text else "gym") in modes and not ALGORITHMS[name].uses(key, text)
    )


def modes_text(modes: tuple[str, ...]) -> str:
    if not modes:
        return "no run (kept so that older configs load)"
    return " and ".join(modes) + " runs"


def markdown() -> str:
    """The reference as Markdown: a table per section."""
    lines = [
        "# Configuration reference",
        "",
        f"Generated from the schema in `unipg/config/` by `{REGENERATE}`; do not edit it by hand. "
        "In a terminal, `unipg config --explain KEY` (or a section, or nothing for all) prints the same.",
        "",
        "Modes: *gym* runs train an MLP on a gymnasium environment, *lm* runs a language model on a text task "
        "(`task.name` set). Items of a list are written `key[].field`, entries of a mapping "
        "`key.<name>.field`.",
        "",
    ]
    for section in sections():
        title = f"`{section.name}`" if section.name else "Top-level keys"
        lines += [f"## {title}", "", section.help, ""]
        if section.modes != MODES:
            lines += [f"Read in {modes_text(section.modes)} only.", ""]
        lines += ["| Key | Type | Default | Read in | Description |", "|---|---|---|---|---|"]
        lines += [markdown_row(doc) for doc in section.keys]
        lines.append("")
    return "\n".join(lines)


def markdown_row(doc: KeyDoc) -> str:
    notes = [doc.help]
    if doc.condition:
        notes.append(f"Read {doc.condition}.")
    if doc.ignored_by:
        notes.append(f"Ignored by {doc.ignored_by}.")
    if doc.presets:
        notes.append(f"Presets: {doc.presets}.")
    cells = [
        f"`{doc.key}`",
        f"`{doc.type}`",
        f"`{doc.default}`",
        modes_text(doc.modes).removesuffix(" runs"),
        " ".join(notes),
    ]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


if __name__ == "__main__":
    print(markdown(), end="")
