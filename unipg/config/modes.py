"""Which mode reads which key, from the declarations on the fields themselves (``read_in`` in
``unipg.config.section``): a field or section without one is read in both modes."""

from __future__ import annotations

from pydantic import BaseModel

from unipg.config.schema import Config
from unipg.config.section import MODES, field_modes


def unread_keys(mode: str) -> frozenset[str]:
    """The keys no run of ``mode`` reads: ``section.*`` for a section declared for the other mode only (it
    covers the section's keys and those inside its mappings, ``task.options.digits``), the dotted key of a
    field otherwise."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; modes are {', '.join(MODES)}")
    keys = set()
    for name, field in Config.model_fields.items():
        if field.exclude:
            continue
        section = (
            field.annotation if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel) else None
        )
        if mode not in field_modes(field):
            keys.add(f"{name}.*" if section is not None else name)
        elif section is not None:
            keys |= {f"{name}.{leaf}" for leaf, inner in section.model_fields.items() if mode not in field_modes(inner)}
    return frozenset(keys)
