"""``unipg config --explain [KEY|SECTION ...]``: the configuration reference (``unipg.config.reference``) as
terminal text, for one key, one section, or everything."""

from __future__ import annotations

import difflib
import textwrap

from unipg.config.loading import FLAT_ALIASES
from unipg.config.reference import KeyDoc, SectionDoc, modes_text, sections
from unipg.config.section import MODES, ConfigError

WIDTH = 100


def explain(queries: list[str]) -> str:
    """The reference of each key or section named (a flat alias names its dotted key), or of every section
    when none is; an unknown name raises ``ConfigError`` naming the nearest one."""
    found = sections()
    if not queries:
        return "\n\n".join(section_text(section) for section in found)
    return "\n\n".join(query_text(query.strip(), found) for query in queries)


def query_text(query: str, found: list[SectionDoc]) -> str:
    by_name = {section.name: section for section in found if section.name}
    if query in by_name:
        return section_text(by_name[query])
    key = FLAT_ALIASES.get(query, query)
    keys = {doc.key: doc for section in found for doc in section.keys}
    spelled = {plain(name): name for name in keys}
    if key not in keys and plain(key) in spelled:  # sft.stages.steps for sft.stages[].steps
        key = spelled[plain(key)]
    if key not in keys:
        names = list(by_name) + list(keys) + ([] if "." in query else list(FLAT_ALIASES))
        raise ConfigError(unknown_message(query, names))
    alias = f"'{query}' is the flat name of {key}\n" if query in FLAT_ALIASES else ""
    inner = [doc for name, doc in keys.items() if name.startswith((f"{key}.", f"{key}[]."))]
    return alias + "\n\n".join(key_text(doc) for doc in [keys[key], *inner])


def plain(key: str) -> str:
    return key.replace("[]", "").replace(".<name>", "")


def unknown_message(query: str, names: list[str]) -> str:
    close = difflib.get_close_matches(query, names, n=1, cutoff=0.6)
    if not close:  # the right key in the wrong section: train.clip_range
        tail = query.rsplit(".", 1)[-1]
        close = [name for name in names if name.rsplit(".", 1)[-1] == tail][:1]
    hint = f"; did you mean '{close[0]}'?" if close else "."
    return (
        f"unknown key or section '{query}'{hint} Run `unipg config --explain` to list every section and key, "
        "or `unipg config --explain SECTION` for one section"
    )


def section_text(section: SectionDoc) -> str:
    title = f"[{section.name}]" if section.name else "[top-level keys]"
    lines = wrap(f"{title} {section.help}", indent="")
    if section.modes != MODES:
        lines += wrap(f"read in {modes_text(section.modes)} only", indent="  ")
    return "\n".join(lines) + "\n\n" + "\n\n".join(key_text(doc) for doc in section.keys)


def key_text(doc: KeyDoc) -> str:
    """A key's name and type, its help, then one labelled line per fact."""
    read_in = modes_text(doc.modes) + (f", {doc.condition}" if doc.condition else "")
    facts = [("default", doc.default), ("presets", doc.presets), ("read in", read_in), ("ignored by", doc.ignored_by)]
    lines = [f"{doc.key}  {doc.type}", *wrap(doc.help, indent="  ")]
    for label, text in facts:
        if text:
            lines += wrap(text, indent=f"  {label + ':':<12}", subsequent=" " * 14)
    return "\n".join(lines)


def wrap(text: str, indent: str, subsequent: str | None = None) -> list[str]:
    return textwrap.wrap(
        text,
        WIDTH,
        initial_indent=indent,
        subsequent_indent=indent if subsequent is None else subsequent,
        break_on_hyphens=False,
        break_long_words=False,
    ) or [indent.rstrip()]
