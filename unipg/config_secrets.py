"""Secrets in a configuration: keys named like one, kept out of what a run saves and read back from the environment.

``redact_secrets`` replaces every secret value with ``REDACTED`` before the configuration is written to
config.yaml, TensorBoard or W&B; ``restore_secrets`` (called by ``Config.model_validate``) puts them back from
environment variables when such a config.yaml is loaded again.
"""

from __future__ import annotations

import os
import re
from typing import Any

from unipg.config_section import ConfigError

REDACTED = "<redacted>"
"""What the configuration saved with a run (config.yaml, TensorBoard, W&B) holds in place of a secret."""
SECRET_WORDS = ("key", "keys", "token", "secret", "secrets", "password", "passwd", "passphrase", "credential",
                "credentials", "auth")


def is_secret_name(name: str) -> bool:
    """Whether a configuration key names a secret: one of its words (split at ``_``, ``-``, ``.`` and camelCase)
    ends in a ``SECRET_WORDS`` entry, as in ``WANDB_API_KEY``, ``hfToken`` or ``apikey``; ``max_new_tokens``
    does not."""
    words = re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", str(name))
    return any(word.lower().endswith(SECRET_WORDS) for word in words)


def redact_secrets(tree: Any, *, secret: bool = False) -> Any:
    """A copy of a configuration dict in which every value under a key named like a secret (``is_secret_name``)
    is ``REDACTED``. Kept as they are: ``None``, ``""`` and booleans (``token: true`` means "use the stored one")."""
    if isinstance(tree, dict):
        return {key: redact_secrets(value, secret=secret or is_secret_name(key)) for key, value in tree.items()}
    if isinstance(tree, list):
        return [redact_secrets(value, secret=secret) for value in tree]
    if secret and tree is not None and tree != "" and not isinstance(tree, bool):
        return REDACTED
    return tree


def restore_secrets(tree: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``tree`` in which each ``REDACTED`` value is read from the environment variable named like its key
    (as written or upper-case); ``ConfigError`` naming the keys that stay redacted and how to pass them again."""
    missing = []

    def restore(node: Any, path: list[str]) -> Any:
        if isinstance(node, dict):
            return {key: restore(value, [*path, str(key)]) for key, value in node.items()}
        if isinstance(node, list):
            return [restore(value, [*path, str(index)]) for index, value in enumerate(node)]
        if not isinstance(node, str) or node != REDACTED:
            return node
        name = next((part for part in reversed(path) if not part.isdigit()), "")
        value = os.environ.get(name, os.environ.get(name.upper()))
        if value is None:
            missing.append(".".join(path))
            return node
        return value

    restored = restore(tree, [])
    if missing:
        raise ConfigError(f"the configuration holds {REDACTED!r} at {', '.join(missing)}: secrets are left out of the "
                          "config.yaml saved with a run. Pass each again as an override (e.g. "
                          f"{missing[0]}=...), or set the environment variable of the same name "
                          f"({missing[0].rsplit('.', 1)[-1]}), which is read in its place")
    return restored
