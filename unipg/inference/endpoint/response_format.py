"""``response_format`` of a chat request: the JSON schema its reply must match, if any.

OpenAI's three forms are honoured: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any JSON
object) and ``{"type": "json_schema", "json_schema": {"name", "description", "schema", "strict"}}``. A JSON reply
is constrained decoding (``unipg.inference.structured``): the engine draws each token only where the schema's
grammar allows it, whether ``strict`` is true or not (OpenAI's ``strict: false`` only tries; here the reply
always matches, unless ``max_tokens`` cuts it: finish reason "length", its JSON unfinished, as OpenAI answers).
Anything else (an unknown type, a schema the grammar library refuses or would not enforce) is a 400 naming
``response_format``.
"""

from __future__ import annotations

import json
import re

from unipg.inference.endpoint.render import RequestError
from unipg.inference.structured import JSON_OBJECT_SCHEMA, schema_problem

SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name
FORMS = 'response_format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}'
JSON_SCHEMA_FIELDS = ("name", "description", "schema", "strict")


def response_schema(response_format) -> str | None:
    """The JSON schema (its text, keys sorted) the reply must match; None for text replies (or no
    ``response_format``). A form that is not OpenAI's or a schema that cannot constrain decoding is a
    ``RequestError`` naming ``response_format``."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    expected = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}.get(kind)
    if expected is None or set(response_format) != expected:
        raise RequestError(FORMS, "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    return _checked_schema(response_format["json_schema"])


def _checked_schema(spec) -> str:
    """The text of ``json_schema.schema``, once ``spec`` is OpenAI's ``json_schema`` object and the schema is one
    constrained decoding enforces."""
    where = "response_format.json_schema"
    if not isinstance(spec, dict) or not set(spec) <= set(JSON_SCHEMA_FIELDS):
        raise RequestError(f"{where} must be an object of {', '.join(JSON_SCHEMA_FIELDS)}", "response_format")
    name = spec.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.fullmatch(name):
        raise RequestError(f"{where}.name must be 1 to 64 letters, digits, underscores or dashes", "response_format")
    if not isinstance(spec.get("description", ""), str) or not isinstance(spec.get("strict", False), bool | None):
        raise RequestError(f"{where}: description must be a string and strict a boolean", "response_format")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise RequestError(f"{where}.schema must be a JSON schema object", "response_format")
    try:
        text = json.dumps(schema, sort_keys=True)
        problem = schema_problem(text)
    except RecursionError:
        problem = "it nests too deeply"
    except ImportError:
        raise RequestError(
            "response_format json_object and json_schema need the xgrammar package on the server (pip install "
            "xgrammar)",
            "response_format",
        ) from None
    if problem is not None:
        raise RequestError(f"Invalid schema for response_format '{name}': {problem}", "response_format")
    return text
