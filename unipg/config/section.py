"""The base of the configuration schema: ``Section``, from which every section derives and which refuses values
pydantic would otherwise convert silently, and ``ConfigError``, raised for a configuration that cannot be used.
"""

from __future__ import annotations

import datetime
import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from pydantic.fields import FieldInfo


class ConfigError(ValueError):
    """A configuration that cannot be used; the message lists every problem and its fix."""


# gym: an MLP on a gymnasium environment; lm: a language model on a text task (``Config.mode``).
MODES = ("gym", "lm")


def read_in(*modes: str) -> dict[str, Any]:
    """The ``json_schema_extra`` of a field or section that only runs of these modes read, e.g.
    ``Field(0.0, json_schema_extra=read_in("lm"))``; a field without it is read in both. ``read_in()``: a key no
    run reads, kept so that older configs still load. The warnings about keys a run ignores
    (``unipg.config.presets``) and ``unipg config --explain`` are derived from these declarations."""
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        raise ValueError(f"unknown mode {unknown[0]!r}; modes are {', '.join(MODES)}")
    return {"modes": modes}


def field_modes(field: FieldInfo) -> tuple[str, ...]:
    """The modes whose runs read a field: those of its ``read_in`` declaration, else both."""
    extra = field.json_schema_extra
    return tuple(extra["modes"]) if isinstance(extra, dict) and "modes" in extra else MODES


def scalar_types(annotation: Any) -> set[type]:
    """The plain types an annotation accepts: ``int | None`` → {int, NoneType}, a Literal of strings → {str}."""
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        return set().union(*(scalar_types(arg) for arg in get_args(annotation)))
    if origin is Literal:
        return {type(arg) for arg in get_args(annotation)}
    return {origin or annotation}


def is_text_field(annotation: Any) -> bool:
    """Whether a field takes text only (a string, a choice of strings, optionally None)."""
    accepted = scalar_types(annotation)
    return str in accepted and accepted <= {str, type(None)}


class Section(BaseModel):
    # allow_inf_nan=False: an infinite or NaN learning rate, coefficient or clip range is always a mistake.
    # use_attribute_docstrings: the docstring under each field is its description (``unipg config --explain``).
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, allow_inf_nan=False, use_attribute_docstrings=True
    )

    @field_validator("*", mode="before")
    @classmethod
    def _reject_lookalike_values(cls, value: Any, info: ValidationInfo) -> Any:
        """Refuse what pydantic would otherwise convert silently: a boolean for a number (``seed: true`` is 1)
        and a YAML boolean, number or date for a text field (``name: no`` is False)."""
        annotation = cls.model_fields[info.field_name].annotation
        accepted = scalar_types(annotation)
        if isinstance(value, bool) and bool not in accepted and accepted & {int, float}:
            raise ValueError("expected a number, not a boolean")
        if is_text_field(annotation) and isinstance(value, (bool, int, float, datetime.date)):
            raise ValueError(
                "expected text; YAML reads unquoted yes/no/on/off/true/false as booleans and 1.5 or "
                "2024-01-01 as a number or a date: quote the value ('no')"
            )
        return value
