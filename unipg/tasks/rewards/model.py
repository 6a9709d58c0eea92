"""A learned reward: a Hugging Face sequence-classification model scoring ``prompt + completion``, registered in
``REWARDS`` as ``reward_model``."""

from __future__ import annotations

import os
from typing import Any

from unipg.tasks.rewards.rules import REWARDS, text_of


class RewardModel:
    """A reward function scoring ``prompt + completion`` with a Hugging Face sequence-classification model.

    The score is ``logits[:, 0]``. Conversational samples are rendered with the tokenizer's chat template
    when it has one (the format reward models are trained on), else their message texts are concatenated.
    """

    def __init__(
        self,
        name_or_path: str,
        *,
        batch_size: int = 16,
        device: str = "cpu",
        max_length: int = 1024,
        dtype: str = "float32",
    ):
        from unipg.config.devices import resolve_device

        self.name_or_path = name_or_path
        self.batch_size = batch_size
        self.device = resolve_device(device)  # cpu, cuda, cuda:N, mps or auto; absent: ConfigError
        self.max_length = max_length
        self.tokenizer, self.model = _load_sequence_classifier(name_or_path, dtype)
        self.model.to(self.device).eval()
        self.__name__ = "reward_model"  # how CombinedReward.from_callables names it

    def __call__(self, prompts: list, completions: list, **columns) -> list[float]:
        conversational = bool(completions) and not isinstance(completions[0], str)
        if conversational and getattr(self.tokenizer, "chat_template", None):
            texts = [
                self.tokenizer.apply_chat_template(_as_messages(p) + _as_messages(c), tokenize=False)
                for p, c in zip(prompts, completions)
            ]
            return self.score(texts, add_special_tokens=False)  # the template already holds them
        return self.score([text_of(p) + text_of(c, "assistant") for p, c in zip(prompts, completions)])

    def score(self, texts: list[str], *, add_special_tokens: bool = True) -> list[float]:
        """logits[:, 0] of each text, in batches of ``batch_size``, truncated to ``max_length`` tokens."""
        import torch

        scores: list[float] = []
        with torch.no_grad():
            for start in range(0, len(texts), self.batch_size):
                encoded = self.tokenizer(
                    texts[start : start + self.batch_size],
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    add_special_tokens=add_special_tokens,
                    return_tensors="pt",
                ).to(self.device)
                logits = self.model(**encoded).logits  # (batch, num_labels)
                scores.extend(logits[:, 0].float().tolist())
        return scores


def _as_messages(sample: Any) -> list[dict]:
    return [{"role": "user", "content": sample}] if isinstance(sample, str) else list(sample)


def _load_sequence_classifier(name_or_path: str, dtype: str = "float32") -> tuple[Any, Any]:
    """(tokenizer, model) from a local folder or hub id, with a pad token set so batches can be padded."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from unipg.config.devices import torch_dtype

    location = os.path.expanduser(name_or_path)
    if location.startswith(("/", ".")) or os.path.exists(location):  # a local folder, not a hub id
        fix = "check the path: it must be a folder written by save_pretrained"
        problem = None if os.path.isdir(location) else "no such directory"
        if problem is None and not os.path.isfile(os.path.join(location, "config.json")):
            problem = "the folder holds no config.json"
        if problem:
            raise ValueError(f"reward model '{name_or_path}' could not be loaded: {problem}; {fix}")
    else:
        fix = "check the hub id, and that the model is downloaded when working offline"
    try:
        tokenizer = AutoTokenizer.from_pretrained(location)
        model = AutoModelForSequenceClassification.from_pretrained(location, dtype=torch_dtype(dtype))
    except Exception as err:  # OSError, ValueError, hub errors...: all mean "cannot load this"
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"reward model '{name_or_path}' could not be loaded ({reason}); {fix}") from None
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        else:  # no token to reuse: add one, and a row for it in the embedding
            tokenizer.add_special_tokens({"pad_token": "<pad>"})
            model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    return tokenizer, model


@REWARDS.register("reward_model")
def reward_model(
    path: str, batch_size: int = 16, device: str = "cpu", max_length: int = 1024, dtype: str = "float32"
) -> RewardModel:
    """A ``RewardModel`` loaded from ``path`` (a local folder or a Hugging Face hub id), in ``dtype`` on ``device``;
    in a run both default to the run's ``device`` and ``model.dtype`` (``reward_defaults``)."""
    return RewardModel(path, batch_size=batch_size, device=device, max_length=max_length, dtype=dtype)
