"""Secrets in a configuration: keys named like one, kept out of what a run saves and read back from the environment.

``redact_secrets`` replaces every secret value with ``REDACTED`` before the configuration is written to
config.yaml, TensorBoard or W&B; ``restore_secrets`` (called by ``Config.model_validate``) puts them back from
environment variables when such a config.yaml is loaded again.
"""

from __future__ import annotations

import os
import re
from typing import Any

from unipg.config.section import ConfigError

REDACTED = "<redacted>"
"""What the configuration saved with a run (config.yaml, TensorBoard, W&B) holds in place of a secret."""
SECRET_WORDS = ("secret", "secrets", "password", "passwd", "passphrase", "credential", "credentials", "apikey")
"""A key holding one of these words names a secret."""
SECRET_PAIRS = {("api", "key"), ("access", "key"), ("private", "key"), ("secret", "key"), ("auth", "key")}
"""A key ending in one of these pairs of words names a secret (``WANDB_API_KEY``)."""
TOKEN_WORDS = ("pad", "eos", "bos", "unk", "sep", "cls", "mask", "stop", "start", "end", "special", "new", "max",
               "min", "num", "total", "prompt", "completion", "image", "audio", "video")
"""Words before ``token`` that make it a vocabulary item or a count (``pad_token``), not a credential."""


def is_secret_name(name: str) -> bool:
    """Whether a configuration key names a credential. Its words (split at ``_``, ``-``, ``.`` and camelCase)
    hold a ``SECRET_WORDS`` entry, end in a ``SECRET_PAIRS`` pair, or end in ``token`` not preceded by a
    ``TOKEN_WORDS`` entry: ``WANDB_API_KEY``, ``hfToken``, ``HF_TOKEN``, ``db_password`` are secrets;
    ``pad_token``, ``max_new_tokens``, ``answer_key`` are not."""
    words = [word.lower() for word in re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", str(name))]
    if not words:
        return False
    if any(word in SECRET_WORDS for word in words) or tuple(words[-2:]) in SECRET_PAIRS:
        return True
    return words[-1] == "token" and (len(words) == 1 or words[-2] not in TOKEN_WORDS)


def redact_secrets(tree: Any, *, secret: bool = False) -> Any:
    """A copy of a configuration dict in which every value under a key named like a secret (``is_secret_name``)
    is ``REDACTED``. Only text is redacted: ``None``, ``""``, numbers and booleans (``token: true`` means "use the
    stored one") are kept, so nothing but a credential's text is ever replaced."""
    if isinstance(tree, dict):
        return {key: redact_secrets(value, secret=secret or is_secret_name(key)) for key, value in tree.items()}
    if isinstance(tree, list):
        return [redact_secrets(value, secret=secret) for value in tree]
    if secret and isinstance(tree, str) and tree != "":
        return REDACTED
    return tree


def drop_redacted(tree: Any) -> Any:
    """A copy of ``tree`` without the entries (dict items, list items) that are ``REDACTED``."""
    if isinstance(tree, dict):
        return {key: drop_redacted(value) for key, value in tree.items() if value != REDACTED}
    if isinstance(tree, list):
        return [drop_redacted(value) for value in tree if value != REDACTED]
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
