"""Stock chat templates of common model families, the check that a template suits multi-turn training, and the
training variants that replace templates that fail it.

The ``.jinja`` files beside this module are the chat templates the model families ship in their
``tokenizer_config.json``: Qwen2.5-Instruct (``qwen2.5``), Qwen3 (``qwen3``), Llama-3.1-Instruct (``llama3.1``) and
Llama-3.2-Instruct (``llama3.2``); ``qwen3-training`` is Qwen3's with every assistant turn rendered as the model
wrote it. ``model.chat_template`` takes one of these names, a path to a Jinja file, or Jinja text.

Multi-turn rollouts append the policy's tokens, then the closing of its turn, the observation and the opening of
the next turn, and never re-render what came before. That layout is the template's own only when the template
renders a conversation as a prefix of its continuation and shows an assistant turn as written.
``prefix_stability_problem`` renders a conversation of k turns and of k+1 and compares them; a template that fails
(Qwen3's drops the reasoning of turns before the last user message and adds an empty reasoning block to the last
turn) is replaced by its training variant when one is known, with a warning naming both.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

FOLDER = Path(__file__).parent
STOCK = ("qwen2.5", "qwen3", "llama3.1", "llama3.2")
NAMES = (*STOCK, "qwen3-training")


@dataclass(frozen=True)
class Family:
    """What a model family's tokenizer holds that its chat template and tool-call format rely on."""

    special_tokens: tuple[str, ...]  # control tokens, dropped from decoded text
    eos_token: str  # ends an assistant turn
    pad_token: str
    bos_token: str | None = None
    added_tokens: tuple[str, ...] = ()  # matched whole but kept in decoded text (``<tool_call>``, ``<think>``)


_QWEN = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_LLAMA = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "<|finetune_right_pad_id|>",
)
_LLAMA_FAMILY = Family(_LLAMA, "<|eot_id|>", "<|finetune_right_pad_id|>", "<|begin_of_text|>")
FAMILIES = {
    "qwen2.5": Family(_QWEN, "<|im_end|>", "<|endoftext|>", added_tokens=("<tool_call>", "</tool_call>")),
    "qwen3": Family(
        _QWEN,
        "<|im_end|>",
        "<|endoftext|>",
        added_tokens=("<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"),
    ),
    "llama3.1": _LLAMA_FAMILY,
    "llama3.2": _LLAMA_FAMILY,
}


def read_template(name: str) -> str:
    """The text of the bundled template ``name`` (one of ``NAMES``)."""
    if name not in NAMES:
        raise ValueError(f"unknown chat template '{name}'; known: {', '.join(NAMES)}")
    return (FOLDER / f"{name}.jinja").read_text(encoding="utf-8")


def resolve_chat_template(spec: str) -> str:
    """The Jinja text ``model.chat_template`` means: a bundled template's name, a file's path, or the text itself."""
    if spec in NAMES:
        return read_template(spec)
    if "{{" in spec or "{%" in spec:
        return spec
    path = Path(spec).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    raise ValueError(
        f"model.chat_template '{spec}' is neither a known template ({', '.join(NAMES)}), nor a file, "
        "nor Jinja text; name one of these, give the path of a .jinja file, or write the template inline"
    )


def family_tokenizer(family: str, chat_template: str | None = None):
    """A character-level tokenizer with ``family``'s special tokens and its stock chat template (or
    ``chat_template``): the layout of that family's conversations, token for token in its control tokens, built
    without downloading anything (tests, experiments with the embedded model's size)."""
    from unipg.policy.embedded import character_tokenizer

    if family not in FAMILIES:
        raise ValueError(f"unknown model family '{family}'; known: {', '.join(FAMILIES)}")
    tokens = FAMILIES[family]
    return character_tokenizer(
        tokens.special_tokens,
        eos_token=tokens.eos_token,
        pad_token=tokens.pad_token,
        bos_token=tokens.bos_token,
        added_tokens=tokens.added_tokens,
        chat_template=chat_template or read_template(family),
    )


# Training variants, each with the markers of the templates it replaces: a template the check refuses is matched
# by what it contains, not by the model's name.
TRAINING_VARIANTS = {"qwen3-training": ("<|im_start|>", "<think>", "</think>")}

_ANSWER = "ANSWER"
_PROBES = (_ANSWER, f"<think>\nreasoning\n</think>\n\n{_ANSWER}")  # a plain turn and one with reasoning


def prefix_stability_problem(tokenizer) -> str | None:
    """What keeps the tokenizer's chat template from laying out turns as rollouts do, or None when nothing does.

    For a turn with and one without reasoning: the prompt followed by the turn, exactly as written, must begin the
    rendered conversation (k turns), and that conversation must begin the one continued by a tool or user message
    (k+1 turns).
    """
    question = [{"role": "user", "content": "question"}]
    prompt = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    for content in _PROBES:
        head = question + [{"role": "assistant", "content": content}]
        base = tokenizer.apply_chat_template(head, tokenize=False)
        if not base.startswith(prompt + content):
            return "it does not show an assistant turn as written" + (
                " (with reasoning)" if "<think>" in content else ""
            )
        for role in ("tool", "user"):
            longer = tokenizer.apply_chat_template(
                head + [{"role": role, "content": "observation"}], tokenize=False, add_generation_prompt=True
            )
            if not longer.startswith(base):
                return f"it rewrites earlier turns when a '{role}' message follows"
    return None


def training_variant(template: str) -> str | None:
    """The name of the training variant that replaces ``template``, or None when none is known."""
    return next((name for name, markers in TRAINING_VARIANTS.items() if all(m in template for m in markers)), None)


def prepare_chat_template(tokenizer, override: str | None = None, *, model: str = "the model"):
    """Set ``override`` (``model.chat_template``) as the tokenizer's chat template; then, if the template cannot lay
    out multi-turn rollouts and a training variant is known, use the variant and warn. Returns the tokenizer."""
    if override:
        tokenizer.chat_template = resolve_chat_template(override)
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not template:
        return tokenizer
    problem = prefix_stability_problem(tokenizer)
    variant = training_variant(template) if problem else None
    if variant is not None:
        tokenizer.chat_template = read_template(variant)
        warnings.warn(
            f"the chat template of '{model}' does not suit multi-turn training: {problem}. Using the "
            f"training variant '{variant}', which renders every assistant turn as written (past reasoning "
            "kept) and the first prompt as the stock template does; set model.chat_template to choose "
            "another",
            stacklevel=2,
        )
    return tokenizer
