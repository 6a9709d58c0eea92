"""Secrets in a configuration: values kept out of what a run saves and read back from the environment.

``redact_secrets`` replaces every secret value with ``REDACTED`` before the configuration is written to
config.yaml, TensorBoard or W&B; ``restore_secrets`` (called by ``Config.model_validate``) puts them back from
environment variables when such a config.yaml is loaded again. A value is a secret when its key is named like
one (``is_secret_name``), when it is an environment variable's (in a mapping or list under an ``env``,
``env_vars`` or ``environment`` key at any depth below the top level, such as ``ray.runtime_env.env_vars`` or an MCP
tool's ``task.tools[i].server.env``) whose name is not in ``CLEAR_ENV_VARS`` or ``ray.env_vars_in_clear``, or when
the text looks like a credential (``looks_like_secret``: a bearer token, an API key, a URL with a password, a JWT).
"""

from __future__ import annotations

import os
import re
from typing import Any

from unipg.config.section import ConfigError

REDACTED = "<redacted>"
"""What the configuration saved with a run (config.yaml, TensorBoard, W&B) holds in place of a secret."""
SECRET_WORDS = (
    "secret",
    "secrets",
    "password",
    "passwd",
    "passphrase",
    "credential",
    "credentials",
    "apikey",
    "cookie",
    "cookies",
    "authorization",
    "bearer",
    "webhook",
    "dsn",
)
"""A key holding one of these words names a secret."""
SECRET_PAIRS = {("api", "key"), ("access", "key"), ("private", "key"), ("secret", "key"), ("auth", "key")}
"""A key ending in one of these pairs of words names a secret (``WANDB_API_KEY``)."""
ENV_STYLE_ENDINGS = ("key", "pat")
"""An upper-case key (an environment variable's name) ending in one of these words names a secret (``MY_KEY``,
``GITHUB_PAT``); a lower-case one may be a task's option (``answer_key``)."""
TOKEN_WORDS = (
    "pad",
    "eos",
    "bos",
    "unk",
    "sep",
    "cls",
    "mask",
    "stop",
    "start",
    "end",
    "special",
    "new",
    "max",
    "min",
    "num",
    "total",
    "prompt",
    "completion",
    "image",
    "audio",
    "video",
)
"""Words before ``token`` that make it a vocabulary item or a count (``pad_token``), not a credential."""
ENV_VARS_KEYS = ("env", "env_vars", "environment")
"""Keys whose mapping (or list) values are environment variables (Ray's ``runtime_env.env_vars``, an MCP server's
``env``, a plugin's): every value under them is a secret unless its name is kept in clear. Not at the top level,
where ``env`` is the gymnasium section; a text value (``task.env: tool``) is a setting, not a mapping."""
CLEAR_ENV_VARS = frozenset(
    {
        "PYTHONPATH",
        "PYTHONHASHSEED",
        "PYTHONUNBUFFERED",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "CUDA_VISIBLE_DEVICES",
        "TOKENIZERS_PARALLELISM",
        "HF_HOME",
        "HF_HUB_OFFLINE",
        "HF_DATASETS_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "TRANSFORMERS_VERBOSITY",
        "TRANSFORMERS_CACHE",
        "NCCL_DEBUG",
        "RAY_DEDUP_LOGS",
        "MALLOC_ARENA_MAX",
        "WANDB_MODE",
        "WANDB_PROJECT",
        "LANG",
        "LC_ALL",
        "TZ",
    }
)
"""Environment variables whose values are saved in clear: settings, never credentials. A run adds its own
names with ``ray.env_vars_in_clear``."""
SECRET_PATTERNS = tuple(
    re.compile(pattern)
    for pattern in (
        r"(?i)\bbearer\s+\S{8,}",  # an Authorization header's value
        r"(?i)\bbasic\s+[A-Za-z0-9+/]{12,}={0,2}",
        r"\b[sr]k[-_](?:live_|test_|proj-|ant-)?[A-Za-z0-9_-]{16,}",  # OpenAI, Anthropic, Stripe keys
        r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}|glpat-[A-Za-z0-9_-]{20,})",  # GitHub, GitLab
        r"\bhf_[A-Za-z0-9]{30,}",  # Hugging Face
        r"\bxox[abposr]-[A-Za-z0-9-]{10,}",  # Slack
        r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b",  # AWS access key id
        r"\bAIza[0-9A-Za-z_-]{30,}",  # Google API key
        r"\beyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}",  # a JWT: base64url JSON header, payload, sig
        r"-----BEGIN [A-Z ]*PRIVATE KEY-----",
        r"(?i)\b[a-z][a-z0-9+.-]*://[^\s/@:]*:[^\s/@]+@",  # a URL with user:password@
        r"(?i)://(?:hooks\.slack\.com/|(?:[a-z0-9-]+\.)?discord(?:app)?\.com/api/webhooks/|[^\s/]*webhook)",
        r"(?i)[?&](?:access_token|api_key|apikey|auth|key|password|secret|sig|signature|token)=[^&\s]{6,}",
    )
)
"""Text matching one of these holds a credential, whatever its key is named."""
LONG_HEX = re.compile(r"[0-9a-fA-F]{32,}")
LONG_BASE64 = re.compile(r"[A-Za-z0-9+/_-]{32,}={0,2}")


def is_secret_name(name: str) -> bool:
    """Whether a configuration key names a credential. Its words (split at ``_``, ``-``, ``.`` and camelCase)
    hold a ``SECRET_WORDS`` entry, end in a ``SECRET_PAIRS`` pair, are upper-case and end in a
    ``ENV_STYLE_ENDINGS`` word, or end in ``token`` not preceded by a ``TOKEN_WORDS`` entry: ``WANDB_API_KEY``,
    ``MY_KEY``, ``hfToken``, ``HF_TOKEN``, ``db_password`` are secrets; ``pad_token``, ``max_new_tokens``,
    ``answer_key`` are not."""
    words = [word.lower() for word in re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", str(name))]
    if not words:
        return False
    if any(word in SECRET_WORDS for word in words) or tuple(words[-2:]) in SECRET_PAIRS:
        return True
    if str(name).isupper() and words[-1] in ENV_STYLE_ENDINGS:
        return True
    return words[-1] == "token" and (len(words) == 1 or words[-2] not in TOKEN_WORDS)


def looks_like_secret(text: str) -> bool:
    """Whether ``text`` holds a credential by its form: a ``SECRET_PATTERNS`` match (bearer token, ``sk-...``
    key, URL with a password, JWT, webhook URL), or the whole text is 32 or more hex digits, or 32 or more
    base64 characters mixing upper case, lower case and digits.

    >>> [looks_like_secret(text) for text in ("Bearer abcdef123456", "postgres://u:pw@db/x", "Qwen/Qwen2.5-0.5B")]
    [True, True, False]
    """
    if any(pattern.search(text) for pattern in SECRET_PATTERNS):
        return True
    text = text.strip()
    if LONG_HEX.fullmatch(text):
        return True
    return bool(LONG_BASE64.fullmatch(text)) and all(re.search(kind, text) for kind in ("[A-Z]", "[a-z]", "[0-9]"))


def redact_secrets(tree: Any) -> Any:
    """A copy of a configuration dict in which every secret value is ``REDACTED``: under a key named like a
    secret, an environment variable's not kept in clear (``CLEAR_ENV_VARS``, ``ray.env_vars_in_clear``), or text
    that looks like a credential. Only text is redacted: ``None``, ``""``, numbers and booleans (``token: true``
    means "use the stored one") are kept, so nothing but a credential's text is ever replaced."""
    ray = tree.get("ray") if isinstance(tree, dict) else None
    own = ray.get("env_vars_in_clear") if isinstance(ray, dict) else None
    clear = CLEAR_ENV_VARS | {str(name) for name in own or ()}
    if not isinstance(tree, dict):
        return _redact(tree, secret=False, clear=clear)
    # the top level's keys are sections, not environment variables: env there is the gymnasium section
    return {key: _redact(value, secret=is_secret_name(key), clear=clear) for key, value in tree.items()}


def _redact(tree: Any, *, secret: bool, clear: frozenset[str] | set[str], env: bool = False) -> Any:
    """``tree`` with its secrets redacted; ``secret``: everything below is one; ``env``: ``tree`` holds environment
    variables, by name (a mapping) or as ``NAME=value`` entries (a list)."""
    if isinstance(tree, dict):
        return {
            key: _redact(
                value,
                secret=secret or is_secret_name(key) or (env and str(key) not in clear),
                clear=clear,
                env=str(key) in ENV_VARS_KEYS,
            )
            for key, value in tree.items()
        }
    if isinstance(tree, list):
        return [
            _redact(value, secret=secret or (env and not _kept_in_clear(value, clear)), clear=clear) for value in tree
        ]
    if isinstance(tree, str) and tree != "" and (secret or looks_like_secret(tree)):
        return REDACTED
    return tree


def _kept_in_clear(entry: Any, clear: frozenset[str] | set[str]) -> bool:
    """Whether an entry of an environment list is a ``NAME=value`` text whose name is kept in clear."""
    return isinstance(entry, str) and entry.partition("=")[0] in clear


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
        raise ConfigError(
            f"the configuration holds {REDACTED!r} at {', '.join(missing)}: secrets are left out of the "
            "config.yaml saved with a run. Pass each again as an override (e.g. "
            f"{missing[0]}=...), or set the environment variable of the same name "
            f"({missing[0].rsplit('.', 1)[-1]}), which is read in its place"
        )
    return restored
