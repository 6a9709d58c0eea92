"""Constrained decoding of JSON replies: the grammar of a JSON schema as a mask on the logits of the rows that
asked for it (``SamplingParams.json_schema``), with xgrammar.

xgrammar compiles a schema against the tokenizer's vocabulary once (``GrammarCompiler``'s cache) and answers, at
every step, which tokens keep the row's text a prefix of a document the schema accepts
(``GrammarMatcher.fill_next_token_bitmask``); the disallowed logits are set to -inf before the row's token is drawn,
so the row's behaviour log-probs are those of the masked distribution. Once the document is complete only the
end tokens are allowed, so a reply ends on EOS as soon as its JSON does. The same library, with the same options,
is the vllm engine's structured-output backend (``vllm_setup``), so both engines constrain a reply alike:

- compact JSON (``COMPACT``): no whitespace between tokens, which an unconstrained whitespace rule would let a
  policy that has not learned JSON repeat until ``max_tokens``;
- xgrammar's strict mode: an object has no properties but those its schema lists, an array no items beyond its
  schema's (a schema may allow more; the reply still matches it).

A schema is checked before anything is sampled (``schema_problem``): one xgrammar refuses, or one with keywords
xgrammar does not enforce (``UNENFORCED``: the reply could break them), is refused with the reason.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator

import torch

JSON_OBJECT_SCHEMA = '{"type": "object"}'  # response_format json_object: any JSON object
COMPACT = {"any_whitespace": False, "separators": (",", ":")}  # xgrammar's options, the vllm engine's too
# Keywords xgrammar accepts but does not enforce: a reply could break them
UNENFORCED = ("multipleOf", "uniqueItems", "contains", "minContains", "maxContains", "propertyNames")
FORMATS = (  # the string formats xgrammar enforces
    "email",
    "date",
    "time",
    "date-time",
    "duration",
    "ipv4",
    "ipv6",
    "hostname",
    "uuid",
    "uri",
    "uri-reference",
    "uri-template",
    "json-pointer",
    "relative-json-pointer",
)
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name → schema
DATA_KEYWORDS = ("enum", "const", "default", "examples", "required")  # values that are data, not schemas
COMPILERS_KEPT = 4  # grammar compilers (one per tokenizer and vocabulary size) kept between sampling calls
SCHEMAS_CHECKED_KEPT = 256  # verdicts of schema_problem kept: an agent sends the same schema at every call
_compilers: OrderedDict[tuple, tuple] = OrderedDict()
_compilers_lock = threading.Lock()  # services of a run (rollout, evaluation) sample on threads of their own


@functools.lru_cache(maxsize=SCHEMAS_CHECKED_KEPT)
def schema_problem(schema: str) -> str | None:
    """Why the JSON schema ``schema`` (text) cannot constrain a reply, or None if it can."""
    import xgrammar

    try:
        xgrammar.Grammar.from_json_schema(schema, **COMPACT)
    except Exception as error:  # noqa: BLE001 — xgrammar raises RuntimeError with its parser's message
        return re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", str(error).strip())[:300]  # without its source location
    for node in _subschemas(json.loads(schema)):
        kinds = node.get("type") if isinstance(node.get("type"), list) else [node.get("type")]
        if unenforced := [keyword for keyword in UNENFORCED if keyword in node]:
            return f"the keyword {unenforced[0]!r} is not enforced by constrained decoding"
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return "allOf with more than one schema is not enforced by constrained decoding"
        if "string" in kinds and "format" in node and node["format"] not in FORMATS:
            return f"the string format {node['format']!r} is not enforced (known formats: {', '.join(FORMATS)})"
        if "string" in kinds and {"pattern", "format"} & node.keys() and {"minLength", "maxLength"} & node.keys():
            return "a string's pattern or format together with minLength or maxLength is not enforced"
        if isinstance(node.get("patternProperties"), dict) and (
            "properties" in node or len(node["patternProperties"]) > 1
        ):
            return "patternProperties beside properties, or more than one pattern, is not enforced"
    return None


def _subschemas(schema) -> Iterator[dict]:
    """Every schema object in ``schema``, itself included (values of data keywords such as ``enum`` are skipped,
    and so are the names of properties, which may be any word)."""
    pending = [schema]
    while pending:
        node = pending.pop()
        if not isinstance(node, dict):
            continue
        yield node
        for keyword, value in node.items():
            if keyword in DATA_KEYWORDS:
                continue
            if keyword in SCHEMA_MAPS and isinstance(value, dict):
                pending += list(value.values())
            elif isinstance(value, dict):
                pending.append(value)
            elif isinstance(value, list):
                pending += value


def grammar_compiler(tokenizer, vocab_size: int, stop_ids: list[int]):
    """xgrammar's compiler for ``tokenizer`` with ``vocab_size`` logits and end tokens ``stop_ids``, built once
    (reading the vocabulary takes seconds for a large one) and kept for later calls."""
    import xgrammar

    key = (id(tokenizer), vocab_size, tuple(stop_ids))
    with _compilers_lock:
        kept = _compilers.get(key)
        if kept is None or kept[0] is not tokenizer:  # the tokenizer is held, so its id is not reused while kept
            info = xgrammar.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_ids)
            )
            kept = _compilers[key] = (tokenizer, xgrammar.GrammarCompiler(info))
            while len(_compilers) > COMPILERS_KEPT:
                _compilers.popitem(last=False)
        _compilers.move_to_end(key)
        return kept[1]


class RowGrammars:
    """The grammars of one batched sampling call: row ``i`` follows ``schemas[i]`` (None: unconstrained). The
    ``generate`` loop calls ``mask`` on each step's logits and ``advance`` with the tokens drawn from them."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int], schemas: list[str | None]):
        import xgrammar

        compiler = grammar_compiler(tokenizer, vocab_size, stop_ids)
        self.matchers = {
            row: xgrammar.GrammarMatcher(compiler.compile_json_schema(schema, **COMPACT))
            for row, schema in enumerate(schemas)
            if schema is not None
        }
        self.bitmask = xgrammar.allocate_token_bitmask(len(schemas), vocab_size)
        # Special tokens other than the end tokens decode to nothing, so the grammar would read text the reply
        # does not have: a constrained row never draws them.
        self.never = sorted(set(getattr(tokenizer, "all_special_ids", [])) - set(stop_ids))
        self.vocab_size = vocab_size

    def mask(self, logits: torch.Tensor, finished: torch.Tensor) -> torch.Tensor:
        """``logits`` (B, V) with the tokens each unfinished constrained row may not draw at -inf (in place)."""
        import xgrammar

        rows = [row for row, done in enumerate(finished.tolist()) if not done and row in self.matchers]
        if not rows:
            return logits
        for row in rows:
            self.matchers[row].fill_next_token_bitmask(self.bitmask, row)
        xgrammar.apply_token_bitmask_inplace(
            logits, self.bitmask.to(logits.device), vocab_size=self.vocab_size, indices=rows
        )
        if self.never:
            rows_at = torch.tensor(rows, device=logits.device)
            logits[rows_at[:, None], torch.tensor(self.never, device=logits.device)] = float("-inf")
        return logits

    def advance(self, tokens: torch.Tensor, finished: torch.Tensor) -> None:
        """Feed each constrained row that was unfinished when it drew its token (``finished`` before the step)."""
        for row, (token, done) in enumerate(zip(tokens.tolist(), finished.tolist())):
            if row in self.matchers and not done and not self.matchers[row].accept_token(token):
                raise RuntimeError(f"row {row} drew token {token}, which its grammar does not allow")
