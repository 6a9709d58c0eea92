"""Prompt rendering shared by sampling and supervised fine-tuning.

Sampling and SFT must turn a task's prompt into exactly the same text, or the policy is trained on one
format and asked to act on another; both go through `render_prompt`. A chat model's own template decides
the format. A base model without a template gets the messages' contents joined by newlines.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

Messages = list[dict[str, str]]


def as_messages(prompt: str | Messages, system_prompt: str | None = None) -> Messages:
    """A prompt as a list of chat messages: a string becomes one user message, led by the system prompt."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt is None:
        return messages
    if any(message.get("role") == "system" for message in messages):
        raise ValueError(
            "the prompt already has a system message and a system_prompt was passed too; keep only one of them"
        )
    return [{"role": "system", "content": system_prompt}, *messages]


def render_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | Messages, system_prompt: str | None = None) -> str:
    """The text a policy continues from: the chat-rendered prompt, ending where the assistant starts.

    With a chat template this is `apply_chat_template(messages, add_generation_prompt=True)`, so the text
    ends with the opening of the assistant's turn. Without one (base models) the contents are joined with
    newlines, system first, and nothing is added after the last message: the completion follows directly.
    """
    messages = as_messages(prompt, system_prompt)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n".join(message["content"] for message in messages)


def completion_suffix(tokenizer: PreTrainedTokenizerBase) -> str:
    """The text that ends an assistant turn: the EOS token, or nothing when the tokenizer has none.

    SFT appends it to every demonstration so that the model learns to stop, and sampling stops on it.
    """
    return tokenizer.eos_token or ""


def check_tokenizer(tokenizer: PreTrainedTokenizerBase, name: str) -> PreTrainedTokenizerBase:
    """Make sure batches can be padded: fall back to EOS as the pad token, or fail with a fix.

    Reusing EOS for padding is the common practice for models shipped without a pad token; padded positions
    are masked out everywhere, so the choice of token does not matter.
    """
    if tokenizer.pad_token is not None:
        return tokenizer
    if tokenizer.eos_token is None:
        raise ValueError(
            f"tokenizer of '{name}' has no pad token and no eos token; set tokenizer.pad_token (for a saved model: "
            '"pad_token" in its tokenizer_config.json, naming a token of the vocabulary) or pass a tokenizer '
            "that defines one"
        )
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def render_tools(tools: list[dict]) -> str:
    """A compact description of the tools and the call format, for models whose template has no tools slot."""
    lines = ['Tools (call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>):']
    for schema in tools:
        function = schema["function"]
        arguments = ", ".join(
            f"{name}: {spec.get('type', 'any')}" for name, spec in function["parameters"].get("properties", {}).items()
        )
        lines.append(f"- {function['name']}({arguments}): {function['description']}")
    return "\n".join(lines)


def render_agent_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: str, system_prompt: str | None, tools: list[dict] | None
) -> str:
    """``render_prompt`` with tool descriptions: through the chat template's ``tools`` argument when the
    template uses it (Qwen, Llama 3.1, Hermes), else appended to the system message."""
    if not tools:
        return render_prompt(tokenizer, prompt, system_prompt)
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, str) and "tools" in template:
        return tokenizer.apply_chat_template(
            as_messages(prompt, system_prompt), tools=tools, tokenize=False, add_generation_prompt=True
        )
    described = render_tools(tools) if system_prompt is None else f"{system_prompt}\n{render_tools(tools)}"
    return render_prompt(tokenizer, prompt, described)


_CONTENT = "\x02CONTENT\x03"  # a placeholder no template rewrites, replaced by the real text afterwards


class TurnTemplate:
    """The text an environment inserts between two policy turns, taken from the chat template.

    After the policy's turn the conversation continues with the rest of the assistant turn's closing text
    (``<|im_end|>\\n`` for Qwen; the part the policy did not write itself when it stopped at EOS), then the
    observation rendered as a message of its role, then the opening of the next assistant turn. All of it is
    inserted as tokens with loss mask 0; the policy's own tokens are never re-tokenized, so the log-probs
    recorded at sampling time stay those of the exact tokens trained on.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, multi_turn: bool = True):
        """``multi_turn``: refuse a template that cannot lay out several turns (``prefix_stability_problem``);
        single-turn episodes never insert anything, so any template serves them."""
        from unipg.policy.templates import prefix_stability_problem

        self.tokenizer = tokenizer
        self.eos_text = tokenizer.eos_token or ""
        self._head = None
        if getattr(tokenizer, "chat_template", None):
            problem = prefix_stability_problem(tokenizer) if multi_turn else None
            if problem:
                raise ValueError(
                    f"the chat template of this tokenizer cannot lay out multi-turn rollouts: {problem}; "
                    "set model.chat_template to a template that shows each assistant turn as written and "
                    "only appends (e.g. qwen3-training for Qwen3)"
                )
            self._head = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _CONTENT}]
            self._base = tokenizer.apply_chat_template(self._head, tokenize=False)
            self.turn_suffix = self._base[self._base.rindex(_CONTENT) + len(_CONTENT) :]
        else:  # base models: a newline-separated transcript
            self.turn_suffix = "\n"

    def closing(self, ended_with_eos: bool) -> str:
        """What completes the policy's turn: the closing text minus the EOS the policy already wrote."""
        if ended_with_eos and self.eos_text and self.turn_suffix.startswith(self.eos_text):
            return self.turn_suffix[len(self.eos_text) :]
        return self.turn_suffix

    def observation(self, content: str, role: str = "tool") -> str:
        """The observation as a message of ``role``, followed by the opening of the next assistant turn.

        Rendered by the template each time (a template may quote or escape the content, as Llama 3's does tool
        output), and cut after the conversation it continues."""
        if role not in ("tool", "user"):
            raise ValueError(f"observations can be 'tool' or 'user' messages, got '{role}'")
        if self._head is None:
            return content + "\n"
        full = self.tokenizer.apply_chat_template(
            self._head + [{"role": role, "content": content}], tokenize=False, add_generation_prompt=True
        )
        if not full.startswith(self._base):
            raise ValueError(f"the chat template rewrote earlier turns when this {role} message followed: {content!r}")
        return full[len(self._base) :]

    def demonstration(self, messages: list[dict]) -> list[tuple[str, bool]]:
        """(text, trained) segments of a multi-turn demonstration, laid out exactly as rollouts lay out turns:
        assistant turns + EOS are trained, closing text and observations are not. An assistant message with
        ``"weight": 0`` (OpenAI's fine-tuning format) is context only: laid out, not trained, e.g. a wrong
        proposal that a critique answers."""
        segments: list[tuple[str, bool]] = []
        for index, message in enumerate(messages):
            if message["role"] == "assistant":
                weight = message.get("weight", 1)
                if weight not in (0, 1):
                    raise ValueError(
                        f"an assistant message's weight is 0 (context only) or 1 (trained), got {weight!r}"
                    )
                segments.append((message["content"] + self.eos_text, weight == 1))
                if index + 1 < len(messages):
                    segments.append((self.closing(ended_with_eos=bool(self.eos_text)), False))
            else:
                segments.append((self.observation(message["content"], message["role"]), False))
        return [(text, trained) for text, trained in segments if text]
