"""One shape for an entry that names a registered task, reward or tool: ``{name, options: {...}}``, plus
``weight`` for a reward (and ``latency`` and ``server`` for a tool). verl nests a custom reward's keyword
arguments the same way (``custom_reward_function.reward_kwargs``).

Rewards used to take their options beside the name (``{name: length, weight: 0.1, max_length: 200}``); that form
is still read, with a warning that shows the entry in the nested form.
"""

from __future__ import annotations

from typing import Any

import yaml

REWARD_KEYS = ("name", "weight", "options")


def reward_spec(entry: Any, where: str) -> tuple[Any, str | None]:
    """``entry`` of a list of rewards in the ``{name, weight, options}`` form, and a warning naming ``where`` when
    it was written with options beside the name (None when it was not). An entry that is not a mapping, or whose
    options are not one, is returned as it is, for the caller's check to report; an option set both beside the
    name and under options raises ValueError."""
    if not isinstance(entry, dict):
        return entry, None
    inline = {key: value for key, value in entry.items() if key not in REWARD_KEYS}
    nested = entry.get("options", {})
    if not inline or not isinstance(nested, dict):
        return entry, None
    twice = sorted(set(inline) & set(nested))
    if twice:
        raise ValueError(
            f"{where} sets {', '.join(twice)} both beside the name and under options; keep the one under options"
        )
    spec = {key: entry[key] for key in ("name", "weight") if key in entry}
    spec["options"] = {**nested, **inline}
    return spec, (
        f"{where}: a reward's options go under 'options'; write {flow(spec)} (options beside the name "
        "are read until the next release)"
    )


def reward_specs(entries: Any, where: str = "task.rewards") -> tuple[Any, list[str]]:
    """Every entry of a list of rewards in the ``{name, weight, options}`` form, and a warning per entry that was
    not; anything but a list is returned as it is."""
    if not isinstance(entries, list):
        return entries, []
    specs, warnings = [], []
    for index, entry in enumerate(entries):
        spec, warning = reward_spec(entry, f"{where}[{index}]")
        specs.append(spec)
        warnings += [warning] if warning else []
    return specs, warnings


def flow(value: Any) -> str:
    """A value in YAML's one-line flow style: {name: length, weight: 0.1, options: {max_length: 200}}."""
    return (
        yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10_000)
        .strip()
        .removesuffix("...")
        .strip()
    )
