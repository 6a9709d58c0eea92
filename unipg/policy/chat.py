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
            "the prompt already has a system message and a system_prompt was passed too; "
            "keep only one of them"
        )
    return [{"role": "system", "content": system_prompt}, *messages]


def render_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | Messages,
                  system_prompt: str | None = None) -> str:
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
            f"tokenizer of '{name}' has no pad token and no eos token; "
            "set tokenizer.pad_token or pass a tokenizer that defines one"
        )
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
