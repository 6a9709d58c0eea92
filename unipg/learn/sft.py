"""Supervised fine-tuning on (prompt, completion) pairs with a completion-only loss: the warm start before RL.

A randomly initialised policy almost never produces a correct answer, so RL from scratch gets no reward to
learn from. A short SFT phase on demonstrations fixes that. The loss is the usual next-token cross-entropy,
averaged over completion tokens only: the prompt is context, not something the policy should learn to write.
The EOS suffix is part of the completion and is trained, so the model learns to stop after its answer.

Prompt and completion are tokenised separately and their ids concatenated, so the prompt/completion
boundary is exact even when a tokenizer would merge characters across it. All pairs are tokenised and padded
once up front; a training step only indexes rows of that table.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from unipg.policy.chat import completion_suffix
from unipg.policy.lm import context_length

IGNORE_INDEX = -100  # label of positions that do not enter the loss (prompt and padding)


@dataclass
class SFTBatch:
    """Right-padded token sequences `prompt ⧺ completion ⧺ padding` with their completion-only labels."""

    input_ids: torch.Tensor  # (B, T) int64 token ids, pad_token_id after each sequence's end
    attention_mask: torch.Tensor  # (B, T) int64, 1 on real tokens and 0 on padding
    labels: torch.Tensor  # (B, T) int64, the token id on completion tokens, IGNORE_INDEX on prompt and padding

    def rows(self, indices: torch.Tensor) -> SFTBatch:
        """The selected rows, cut to the longest of them so that a batch carries no all-padding column."""
        length = int(self.attention_mask[indices].sum(dim=1).max())
        return SFTBatch(
            self.input_ids[indices, :length], self.attention_mask[indices, :length], self.labels[indices, :length]
        )

    def to(self, device: torch.device) -> SFTBatch:
        return SFTBatch(self.input_ids.to(device), self.attention_mask.to(device), self.labels.to(device))


Completion = str | list[tuple[str, bool]]  # a completion text, or (text, trained) segments of several turns


def tokenize_pairs(
    tokenizer: PreTrainedTokenizerBase, pairs: list[tuple[str, Completion]]
) -> list[tuple[list[int], list[int], list[bool]]]:
    """Token ids of each (rendered prompt, completion), and which completion tokens are trained.

    A text completion gets the EOS suffix and is trained entirely. A multi-turn demonstration comes as
    (text, trained) segments (``TurnTemplate.demonstration``): the policy's turns are trained, tool outputs
    and template text are context, exactly as the loss mask of a rollout. Segments are tokenised separately,
    the way rollouts insert them. `add_special_tokens=False` because the rendered prompt already holds every
    marker the template wants; letting the tokenizer add a BOS would put one where sampling has none.
    """
    suffix = completion_suffix(tokenizer)
    prompts = tokenizer([prompt for prompt, _ in pairs], add_special_tokens=False)["input_ids"]
    tokenized = []
    for prompt_ids, (_, completion) in zip(prompts, pairs):
        segments = [(completion + suffix, True)] if isinstance(completion, str) else completion
        ids, trained = [], []
        for text, is_trained in segments:
            segment_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += segment_ids
            trained += [is_trained] * len(segment_ids)
        tokenized.append((prompt_ids, ids, trained))
    return tokenized


def fit_context(tokenized: list[tuple], context: int | None) -> list[tuple]:
    """Examples cut to the model's context, as rollouts cut them: a prompt keeps its last tokens (leaving room
    for one completion token), then the completion is cut at the end. Past the context a model with learned
    positions fails with an index error."""
    if context is None:
        return tokenized
    fitted = []
    for prompt_ids, ids, trained in tokenized:
        prompt_ids = prompt_ids[-(context - 1) :]
        room = context - len(prompt_ids)
        fitted.append((prompt_ids, ids[:room], trained[:room]))
    return fitted


def build_sft_batch(examples: list[tuple], pad_token_id: int) -> SFTBatch:
    """Concatenate each example's prompt and completion ids, right-pad, and label the trained completion tokens.

    Examples are (prompt_ids, completion_ids) or (prompt_ids, completion_ids, trained) with ``trained`` one
    flag per completion token. Labels are aligned with `input_ids` (not shifted); `completion_loss` shifts.
    """
    length = max(len(example[0]) + len(example[1]) for example in examples)
    input_ids = torch.full((len(examples), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
    for row, (prompt, completion, *trained) in enumerate(examples):
        end = len(prompt) + len(completion)
        input_ids[row, :end] = torch.tensor(prompt + completion, dtype=torch.long)
        attention_mask[row, :end] = 1
        completion_labels = torch.tensor(completion, dtype=torch.long)
        if trained:
            completion_labels[~torch.tensor(trained[0], dtype=torch.bool)] = IGNORE_INDEX
        labels[row, len(prompt) : end] = completion_labels
    return SFTBatch(input_ids, attention_mask, labels)


def completion_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-mean cross-entropy −(1/N) Σ log π(y_t | y_<t) over labelled tokens, and next-token accuracy.

    logits: (B, T, V) scores for the token after each position; labels: (B, T) with IGNORE_INDEX where the
    token does not count. Position t predicts token t+1, hence the shift by one.
    """
    predicted = logits[:, :-1].float()  # (B, T-1, V)
    targets = labels[:, 1:]  # (B, T-1)
    loss = F.cross_entropy(predicted.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    counted = targets != IGNORE_INDEX
    correct = (predicted.argmax(dim=-1) == targets) & counted
    token_accuracy = correct.sum() / counted.sum().clamp(min=1)
    return loss, token_accuracy


def sft_learning_rate(
    step: int, *, peak: float, warmup_steps: int, total_steps: int, final_fraction: float = 0.1
) -> float:
    """Learning rate at 0-based `step`: linear warmup to `peak`, then cosine decay to `final_fraction · peak`.

    lr(s) = peak · (s+1)/W for s < W, else peak · (f + (1−f) · ½(1 + cos(π · (s−W)/(S−W−1)))).
    """
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    decay_steps = max(total_steps - warmup_steps - 1, 1)
    progress = min((step - warmup_steps) / decay_steps, 1.0)
    return peak * (final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * progress)))


def shuffled_batches(num_examples: int, batch_size: int, generator: torch.Generator):
    """Yield index tensors of `batch_size` rows forever, walking through one random permutation per epoch."""
    pending = torch.empty(0, dtype=torch.long)
    while True:
        while len(pending) < batch_size:
            pending = torch.cat([pending, torch.randperm(num_examples, generator=generator)])
        yield pending[:batch_size]
        pending = pending[batch_size:]


def length_grouped_batches(lengths: list[int], batch_size: int, generator: torch.Generator, *, group: int = 16):
    """Like `shuffled_batches`, but rows of similar length share a batch, so little of it is padding.

    Each epoch's random permutation is cut into pools of `group` batches; a pool is sorted by length and cut
    into batches, and the batches are yielded in random order. A batch still draws its rows from across the
    dataset (within one length band). The rows left over after the epoch's last full batch wait for the next
    epoch, so every batch has `batch_size` rows. On demonstrations of mixed lengths (one-turn answers beside
    multi-turn tool calls) this cuts the padded tokens per step by up to half.
    """
    if len(lengths) < batch_size:
        yield from shuffled_batches(len(lengths), batch_size, generator)
        return
    lengths_tensor = torch.as_tensor(lengths)
    while True:
        order = torch.randperm(len(lengths), generator=generator)
        order = order[: len(order) - len(order) % batch_size]
        batches = []
        for start in range(0, len(order), batch_size * group):
            pool = order[start : start + batch_size * group]
            pool = pool[torch.argsort(lengths_tensor[pool], stable=True)]
            batches.extend(pool.split(batch_size))
        for index in torch.randperm(len(batches), generator=generator):
            yield batches[index]


def require_pad_token(tokenizer: PreTrainedTokenizerBase) -> int:
    if tokenizer.pad_token_id is None:
        raise ValueError(
            "the tokenizer has no pad token, so batches cannot be padded; "
            "call unipg.policy.chat.check_tokenizer(tokenizer, name) first"
        )
    return tokenizer.pad_token_id


def make_optimizer(model: torch.nn.Module, learning_rate: float, weight_decay: float) -> torch.optim.AdamW:
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    # The fused kernel is several times faster than the per-tensor loop for a model of many small tensors.
    fused = all(parameter.device.type in ("cpu", "cuda") for parameter in parameters)
    return torch.optim.AdamW(parameters, lr=learning_rate, weight_decay=weight_decay, fused=fused)


class TrainingClock:
    """Wall time spent training, with the time spent in callbacks (``paused``) left out."""

    def __init__(self):
        self.seconds, self._since, self._windowed = 0.0, time.perf_counter(), 0.0

    @contextmanager
    def paused(self):
        self.seconds += time.perf_counter() - self._since
        try:
            yield
        finally:
            self._since = time.perf_counter()

    def window(self) -> float:
        """Training seconds since the last call (call it while paused)."""
        window, self._windowed = self.seconds - self._windowed, self.seconds
        return window

    def total(self) -> float:
        return self.seconds + time.perf_counter() - self._since


class _RecentMetrics:
    """The loss and token accuracy of the last ``size`` steps, kept as scalar tensors and read only when asked."""

    def __init__(self, size: int):
        self.losses, self.accuracies = deque(maxlen=size), deque(maxlen=size)

    def add(self, loss: torch.Tensor, token_accuracy: torch.Tensor) -> None:
        self.losses.append(loss)
        self.accuracies.append(token_accuracy)

    def metrics(self) -> dict:
        """Their means: ``loss`` and ``token_accuracy``."""
        return {
            "loss": torch.stack(list(self.losses)).mean().item(),
            "token_accuracy": torch.stack(list(self.accuracies)).mean().item(),
        }


# The default learning rate suits the embedded tiny model: on two-digit addition at batch 64 over 600 steps
# it reached 90% held-out greedy accuracy after 300 and 550 steps (two seeds), where 3e-3 took 500 steps
# and never got there; in longer schedules 3e-3 also oscillated.
def sft_train(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    pairs: list[tuple[str, Completion]],
    *,
    steps: int,
    batch_size: int = 64,
    learning_rate: float = 1e-3,
    warmup_steps: int = 20,
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
    seed: int = 0,
    group_by_length: bool = False,
    log_every: int = 50,
    on_log: Callable[[int, dict], None] | None = None,
    stop_every: int = 0,
    should_stop: Callable[[int], bool] | None = None,
) -> dict:
    """Fine-tune `model` in place on (rendered prompt, completion) pairs; return the final metrics.

    The caller renders prompts with `render_prompt`; the EOS suffix is appended here. Mini-batches are drawn
    by a generator seeded with `seed`, grouped by length when `group_by_length` (see
    `length_grouped_batches`). `on_log(step, metrics)` is called every `log_every` steps with the
    mean loss and token accuracy of the last `log_every` steps; the returned dict holds the same means at the
    end (`loss`, `token_accuracy`), the number of `steps` and the wall-clock `seconds` spent training (time
    inside `on_log` excluded). With `should_stop`, it is asked every `stop_every` steps (`should_stop(step)`,
    its time excluded too) and training ends when it says so; `steps` (and the learning-rate schedule) is then
    a cap, and the returned `steps` those taken. The model is left in eval mode.
    """
    if not pairs:
        raise ValueError("sft_train needs at least one (prompt, completion) pair")
    device = next(model.parameters()).device
    dataset, batches, tokens_per_batch = sft_batches(
        model, tokenizer, pairs, batch_size=batch_size, seed=seed, group_by_length=group_by_length
    )
    optimizer = make_optimizer(model, learning_rate, weight_decay)
    recent = _RecentMetrics(log_every)
    model.train()
    clock = TrainingClock()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = sft_learning_rate(step, peak=learning_rate, warmup_steps=warmup_steps, total_steps=steps)
        recent.add(*sft_step(model, optimizer, dataset.rows(next(batches)).to(device), max_grad_norm, tokens_per_batch))
        if on_log is not None and (step + 1) % log_every == 0:
            with clock.paused():
                metrics = {**recent.metrics(), "learning_rate": optimizer.param_groups[0]["lr"]}
                on_log(step + 1, {**metrics, "steps_per_second": log_every / clock.window()})
        if should_stop is not None and stop_every and (step + 1) % stop_every == 0 and step + 1 < steps:
            with clock.paused():
                stopped = should_stop(step + 1)
            if stopped:
                steps = step + 1
                break
    model.eval()
    final = recent.metrics() if steps > 0 else {"loss": float("nan"), "token_accuracy": float("nan")}
    return {**final, "steps": steps, "seconds": clock.total()}


def sft_batches(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    pairs: list[tuple[str, Completion]],
    *,
    batch_size: int,
    seed: int,
    group_by_length: bool,
):
    """The tokenized pairs as one ``SFTBatch``, an endless iterator of mini-batch row indices drawn by a generator
    seeded with ``seed``, and the token count each loss is divided by (None: each batch's own, see ``sft_step``)."""
    tokenized = fit_context(tokenize_pairs(tokenizer, pairs), context_length(model))
    dataset = build_sft_batch(tokenized, pad_token_id=require_pad_token(tokenizer))
    generator = torch.Generator().manual_seed(seed)
    if not group_by_length:
        return dataset, shuffled_batches(len(pairs), batch_size, generator), None
    batches = length_grouped_batches(
        [len(prompt) + len(completion) for prompt, completion, _ in tokenized], batch_size, generator
    )
    # A batch of short rows must not weigh as much as a batch of long ones: divide by the token count
    # of an average batch, not by this batch's own.
    tokens_per_batch = batch_size * float((dataset.labels[:, 1:] != IGNORE_INDEX).sum()) / len(pairs)
    return dataset, batches, tokens_per_batch


def sft_step(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    batch: SFTBatch,
    max_grad_norm: float,
    tokens_per_batch: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One gradient step on the completion loss; returns the (detached) token-mean loss and token accuracy.

    With `tokens_per_batch` the step minimises the token sum divided by that constant instead of by the
    batch's own token count, so that each token weighs the same whatever else shares its batch.
    """
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    loss, token_accuracy = completion_loss(logits, batch.labels)
    objective = loss
    if tokens_per_batch is not None:
        objective = loss * (batch.labels[:, 1:] != IGNORE_INDEX).sum() / tokens_per_batch
    optimizer.zero_grad(set_to_none=True)
    objective.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.detach(), token_accuracy.detach()
