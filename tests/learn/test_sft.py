import copy
import math

import pytest
import torch
import torch.nn.functional as F

from unipg.learn.sft import (
    IGNORE_INDEX,
    build_sft_batch,
    completion_loss,
    fit_context,
    length_grouped_batches,
    sft_learning_rate,
    sft_step,
    sft_train,
    shuffled_batches,
    tokenize_pairs,
)
from unipg.learn.sft_eval import greedy_completions, sft_accuracy
from unipg.policy.chat import render_prompt
from unipg.policy.embedded import build_model, build_tokenizer

PAD = 0


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_labels_cover_the_completion_only():
    batch = build_sft_batch([([5, 6, 7], [8, 1]), ([5], [9, 1])], pad_token_id=PAD)
    X = IGNORE_INDEX
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 1], [5, 9, 1, PAD, PAD]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert batch.labels.tolist() == [[X, X, X, 8, 1], [X, 9, 1, X, X]]


def test_rows_are_cut_to_their_longest_sequence():
    batch = build_sft_batch([([5, 6, 7], [8, 1]), ([5], [9, 1]), ([4], [1])], pad_token_id=PAD)
    subset = batch.rows(torch.tensor([2, 1]))
    assert subset.input_ids.tolist() == [[4, 1, PAD], [5, 9, 1]]
    assert subset.labels.tolist() == [[IGNORE_INDEX, 1, IGNORE_INDEX], [IGNORE_INDEX, 9, 1]]


def test_prompt_and_completion_are_tokenised_apart_and_the_eos_is_appended(tokenizer):
    prompt = render_prompt(tokenizer, "37+48=")
    [(prompt_ids, completion_ids, trained)] = tokenize_pairs(tokenizer, [(prompt, "85")])
    assert prompt_ids == tokenizer.encode(prompt, add_special_tokens=False) and len(prompt_ids) == 9
    assert completion_ids == tokenizer.convert_tokens_to_ids(["8", "5", "<|end|>"])


def test_completion_loss_matches_a_hand_computation():
    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0], [1.0, 1.0, 1.0]]])
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 2, 0]])
    loss, token_accuracy = completion_loss(logits, labels)
    # Position 1 predicts token 2 and position 2 predicts token 0; position 0's target is ignored.
    expected = (-F.log_softmax(logits[0, 1], -1)[2] - F.log_softmax(logits[0, 2], -1)[0]) / 2
    torch.testing.assert_close(loss, expected)
    assert token_accuracy.item() == 0.0  # argmax is 1 then 2, targets are 2 then 0


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    schedule = [sft_learning_rate(step, peak=1.0, warmup_steps=4, total_steps=20) for step in range(20)]
    assert schedule[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(later <= earlier for earlier, later in zip(schedule[4:], schedule[5:]))
    assert math.isclose(schedule[-1], 0.1)


def test_batches_walk_through_every_example_each_epoch():
    batches = shuffled_batches(10, 4, torch.Generator().manual_seed(0))
    first_epochs = torch.cat([next(batches) for _ in range(5)])
    assert sorted(first_epochs.tolist()) == sorted(list(range(10)) * 2)
    again = shuffled_batches(10, 4, torch.Generator().manual_seed(0))
    assert torch.equal(next(again), first_epochs[:4])


def test_length_grouped_batches_hold_rows_of_one_length_band_and_cover_each_epoch():
    lengths = [120 if row % 5 == 0 else 40 for row in range(200)]
    batches = length_grouped_batches(lengths, 8, torch.Generator().manual_seed(0), group=25)
    epoch = [next(batches) for _ in range(25)]
    assert sorted(torch.cat(epoch).tolist()) == list(range(200))
    mixed = [batch for batch in epoch if len({lengths[row] for row in batch}) > 1]
    assert len(mixed) <= 1 and all(len(batch) == 8 for batch in epoch)


def test_a_fixed_token_normaliser_weighs_each_token_the_same_in_any_batch(tokenizer):
    """Grouped by length, a batch's loss is its token sum over a fixed count, so a batch of short rows gets a
    proportionally smaller gradient than a batch of long rows, as in an ungrouped batch holding both."""
    pairs = [(render_prompt(tokenizer, "2+2="), "4"), (render_prompt(tokenizer, "2+2="), "4444444444")]
    batch = build_sft_batch(tokenize_pairs(tokenizer, pairs), pad_token_id=tokenizer.pad_token_id)
    short = batch.rows(torch.tensor([0]))
    gradients = []
    for tokens_per_batch in (None, 8.0):
        model = build_model(tokenizer, seed=0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        sft_step(model, optimizer, short, max_grad_norm=1e9, tokens_per_batch=tokens_per_batch)
        gradients.append(model.lm_head.weight.grad.clone())
    trained = int((short.labels[:, 1:] != IGNORE_INDEX).sum())  # "4" and the end token
    torch.testing.assert_close(gradients[1], gradients[0] * trained / 8.0)


def test_a_tokenizer_without_pad_token_is_refused_with_the_fix(tokenizer):
    no_pad = copy.deepcopy(tokenizer)
    no_pad.pad_token = None
    with pytest.raises(ValueError, match="check_tokenizer"):
        sft_train(build_model(tokenizer), no_pad, [("<|user|>1+1=<|end|><|assistant|>", "2")], steps=1)


def test_demonstrations_longer_than_the_context_are_cut_like_rollouts(tokenizer):
    model = build_model(tokenizer)
    context = model.config.max_position_embeddings
    long_prompt = "<|user|>" + "1+" * context + "1=<|end|><|assistant|>"
    pairs = [(long_prompt, "7" * 20), ("<|user|>1+1=<|end|><|assistant|>", "2" * (2 * context))]
    tokenized = fit_context(tokenize_pairs(tokenizer, pairs), context)
    assert all(len(prompt) + len(completion) <= context for prompt, completion, _ in tokenized)
    assert tokenized[0][0][-3:] == tokenize_pairs(tokenizer, pairs)[0][0][-3:]  # a prompt keeps its end
    assert len(tokenized[0][1]) >= 1
    sft_train(model, tokenizer, pairs, steps=1, batch_size=2)  # trains within the positions the model has


@pytest.fixture
def one_thread():
    """Run on one intra-op thread, restoring the count afterwards.

    With two threads on a two-core machine, a step slows down by an order of magnitude or more whenever
    another process holds a core, because every parallel region waits for its descheduled thread. One
    thread is about as fast on matrices this small and keeps the test's time stable.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_short_sft_learns_single_digit_addition(tokenizer, one_thread):
    pairs = [(render_prompt(tokenizer, f"{a}+{b}="), str(a + b)) for a in range(10) for b in range(10)]
    model = build_model(tokenizer, seed=0)
    logged = []
    result = sft_train(
        model,
        tokenizer,
        pairs,
        steps=100,
        batch_size=32,
        learning_rate=3e-3,
        seed=0,
        log_every=10,
        on_log=lambda step, metrics: logged.append((step, metrics)),
    )
    assert [step for step, _ in logged] == list(range(10, 101, 10))
    assert result["steps"] == 100 and not model.training
    assert result["loss"] < 0.25 * logged[0][1]["loss"]
    assert result["token_accuracy"] > 0.8
    assert sft_accuracy(model, tokenizer, pairs) >= 0.8

    # Left padding must not change what a prompt decodes to: the two short prompts are padded in the batch.
    short_prompts = [pairs[5][0], pairs[42][0]]
    longer_prompt = render_prompt(tokenizer, "3+4=", system_prompt="Add the numbers.")
    batched = greedy_completions(model, tokenizer, [*short_prompts, longer_prompt])
    assert batched[:2] == [greedy_completions(model, tokenizer, [prompt])[0] for prompt in short_prompts]
