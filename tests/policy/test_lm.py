import pytest
import torch

from unipg.policy.forward import left_pad
from unipg.policy.lm import LMPolicy
from unipg.policy.loading import load_lm_policy, load_tokenizer


def prompts(tokenizer, count=4):
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{i}{i}+{i + 3}="}], tokenize=False, add_generation_prompt=True
        )
        for i in range(count)
    ]
    texts[0] = "7" + texts[0]  # rows of different lengths exercise the left padding
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


@pytest.fixture
def policy(tiny_policy):
    return tiny_policy(value_head=True, reference="copy", needs_reference=True)


def full_batch(generation):
    ids = torch.cat([generation.prompt_ids, generation.completion_ids], dim=1)
    mask = torch.cat([generation.prompt_mask, generation.completion_mask], dim=1)
    return ids, mask


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_training_forward_reproduces_sampling_logprobs(policy, temperature):
    generation = policy.sample(
        prompts(policy.tokenizer),
        max_new_tokens=12,
        temperature=temperature,
        generator=torch.Generator().manual_seed(1),
    )
    ids, mask = full_batch(generation)
    evaluated = policy.evaluate(ids, mask, generation.completion_ids.shape[1], temperature=temperature).logprobs
    valid = generation.completion_mask.bool()
    assert valid.sum() > 8
    assert torch.allclose(evaluated[valid], generation.behaviour_logprobs[valid], atol=1e-4)


def test_completion_mask_stops_at_eos_and_padding_does_not_change_logprobs(policy):
    generation = policy.sample(prompts(policy.tokenizer), max_new_tokens=12, generator=torch.Generator().manual_seed(2))
    for row, length in enumerate(generation.completion_lengths.tolist()):
        tokens = generation.completion_ids[row]
        assert generation.completion_mask[row, :length].all() and not generation.completion_mask[row, length:].any()
        if generation.finish_reasons[row] == "stop":
            assert tokens[length - 1].item() in policy.eos_ids
    ids, mask = full_batch(generation)
    noisy = ids.clone()
    noisy[mask == 0] = 17  # garbage where the attention mask is 0: left prompt padding and completion padding
    width = generation.completion_ids.shape[1]
    clean = policy.evaluate(ids, mask, width).logprobs
    perturbed = policy.evaluate(noisy, mask, width).logprobs
    valid = generation.completion_mask.bool()
    assert torch.allclose(clean[valid], perturbed[valid], atol=1e-5)


def test_greedy_is_deterministic_and_top_k_one_is_greedy(policy):
    ids = prompts(policy.tokenizer)
    greedy = policy.sample(ids, max_new_tokens=6, temperature=0.0)
    again = policy.sample(ids, max_new_tokens=6, temperature=0.0)
    top1 = policy.sample(ids, max_new_tokens=6, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(3))
    assert torch.equal(greedy.completion_ids, again.completion_ids)
    assert torch.equal(greedy.completion_ids, top1.completion_ids)


def test_max_new_tokens_and_stop_strings_end_generation(policy):
    ids = prompts(policy.tokenizer)
    generation = policy.sample(ids, max_new_tokens=3, temperature=1.0, generator=torch.Generator().manual_seed(4))
    assert generation.completion_ids.shape[1] <= 3
    assert all(reason in ("stop", "length") for reason in generation.finish_reasons)
    # every character is one token in the embedded tokenizer, so a stop string of any sampled character fires
    long = policy.sample(ids, max_new_tokens=20, temperature=1.0, generator=torch.Generator().manual_seed(5))
    row = next(row for row, text in enumerate(long.texts) if len(text) >= 2)  # StopIteration fails the test
    stop = long.texts[row][1]
    cut = policy.sample(
        ids, max_new_tokens=20, temperature=1.0, stop=[stop], generator=torch.Generator().manual_seed(5)
    )
    assert stop not in cut.texts[row] and cut.finish_reasons[row] == "stop"


def test_save_and_load_round_trip_keeps_policy_and_critic(policy, tmp_path):
    with torch.no_grad():
        policy.value_head.linear.bias.fill_(0.25)  # a critic state that differs from a fresh head
    generation = policy.sample(prompts(policy.tokenizer), max_new_tokens=6, temperature=0.0)
    ids, mask = full_batch(generation)
    width = generation.completion_ids.shape[1]
    before = policy.evaluate(ids, mask, width, with_values=True)
    loaded = load_lm_policy(str(policy.save(tmp_path / "saved")), value_head=True)
    after = loaded.evaluate(ids, mask, width, with_values=True)
    assert torch.allclose(before.logprobs, after.logprobs, atol=1e-6)
    assert torch.allclose(before.values, after.values, atol=1e-6)


def test_reference_equals_policy_before_training(policy):
    generation = policy.sample(prompts(policy.tokenizer), max_new_tokens=6, generator=torch.Generator().manual_seed(6))
    ids, mask = full_batch(generation)
    width = generation.completion_ids.shape[1]
    assert torch.equal(policy.reference_logprobs(ids, mask, width), policy.evaluate(ids, mask, width).logprobs.detach())


def test_lora_reference_is_the_adapter_disabled_model(embedded_path):
    pytest.importorskip("peft")
    policy = load_lm_policy(embedded_path, lora_rank=4, needs_reference=True)
    assert policy.reference_mode == "adapter" and policy._reference is None
    trainable = {name for name, p in policy.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora" in name for name in trainable)
    generation = policy.sample(prompts(policy.tokenizer), max_new_tokens=6, generator=torch.Generator().manual_seed(7))
    ids, mask = full_batch(generation)
    width = generation.completion_ids.shape[1]
    with torch.no_grad():
        for name, parameter in policy.model.named_parameters():
            if "lora_B" in name:
                parameter.add_(0.05)  # move the adapter: the policy changes, the reference must not
    base = policy.reference_logprobs(ids, mask, width)
    adapted = policy.evaluate(ids, mask, width).logprobs
    assert not torch.allclose(base, adapted)
    assert torch.allclose(
        base[generation.completion_mask.bool()],
        generation.behaviour_logprobs[generation.completion_mask.bool()],
        atol=1e-4,
    )


def test_bad_model_path_says_what_to_fix(tmp_path):
    with pytest.raises(ValueError, match="not found.*save_pretrained"):
        load_lm_policy(str(tmp_path / "no-such-model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="could not load"):
        load_lm_policy(str(tmp_path / "empty"))


@pytest.mark.parametrize(
    ("damaged", "message"),
    [
        ("model.safetensors", "causal language model.*SafetensorError"),
        ("tokenizer.json", "tokenizer.*intact"),
        ("value_head.pt", "value head.*damaged"),
    ],
)
def test_a_truncated_model_file_is_a_clear_error_naming_it(embedded_path, tmp_path, damaged, message):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(embedded_path, folder)
    if damaged == "value_head.pt":
        torch.save({"weight": torch.zeros(1)}, folder / damaged)
    path = folder / damaged
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=message) as raised:
        load_lm_policy(str(folder), value_head=True)
    assert "\n" not in str(raised.value)


def test_tokenizer_without_pad_or_eos_is_rejected_with_a_fix(embedded_path, tmp_path):
    tokenizer = load_tokenizer(embedded_path)
    tokenizer.pad_token = None
    tokenizer.eos_token = None
    tokenizer.save_pretrained(tmp_path / "bare")
    with pytest.raises(ValueError, match="pad token"):
        load_tokenizer(str(tmp_path / "bare"))


def test_policy_wraps_any_causal_lm_object(embedded_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy = LMPolicy(AutoModelForCausalLM.from_pretrained(embedded_path), AutoTokenizer.from_pretrained(embedded_path))
    generation = policy.sample(prompts(policy.tokenizer), max_new_tokens=4, temperature=0.0)
    assert len(generation.texts) == 4 and not policy.has_critic and not policy.has_reference


def test_the_left_padding_of_rows_that_left_the_batch_leaves_the_cache(policy, monkeypatch):
    """The two longest prompts' rows end at their first token: once they leave the batch, the cache columns only
    their prompts filled are dropped, and every other row samples what it samples with them kept."""
    import unipg.policy.forward as forward
    import unipg.policy.generation as generation

    ids = [[5] * 40, [6] * 40, *prompts(policy.tokenizer, count=4)]
    eos, draw = policy.eos_ids[0], generation.draw_next

    def first_row_ends_at_once(logits, temperature, top_k, top_p, generator):
        token, log_dist = draw(logits, temperature, top_k, top_p, generator)
        token[token == eos] = eos + 1  # every other row runs to max_new_tokens
        token[:2] = eos if len(steps) == 0 else token[:2]
        steps.append(len(steps))
        return token, log_dist

    widths, trim = [], generation._trim_left_padding
    monkeypatch.setattr(generation, "draw_next", first_row_ends_at_once)
    monkeypatch.setattr(generation, "_trim_left_padding", lambda cache, mask: _record(widths, trim(cache, mask)))
    steps = []
    trimmed = policy.sample(ids, max_new_tokens=8, temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert widths and widths[0] < 40  # the 40-token prompts' padding columns left with it
    for module in (forward, generation):  # no row selection: every row to the end, the padding kept
        monkeypatch.setattr(module, "plain_cache", lambda cache: False)
    steps = []
    kept = policy.sample(ids, max_new_tokens=8, temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert trimmed.completion_lengths.tolist() == [1, 1] + [8] * 4
    assert torch.equal(kept.completion_ids, trimmed.completion_ids) and kept.texts == trimmed.texts
    assert torch.allclose(kept.behaviour_logprobs, trimmed.behaviour_logprobs, atol=1e-4)


def _record(widths, mask):
    widths.append(mask.shape[1])
    return mask


def test_left_padding_ends_every_prompt_at_the_last_column():
    input_ids, attention_mask = left_pad([[7, 8, 9], [5]], pad_id=0)
    assert input_ids.tolist() == [[7, 8, 9], [0, 0, 5]]
    assert attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_rows_that_finish_early_leave_the_batch_without_changing_the_samples(policy, monkeypatch):
    """When a quarter of the rows have ended, generation drops them from the KV cache and the batch; the same tokens are
    sampled, with the same log-probs, as when every row is computed to the end."""
    from transformers.cache_utils import DynamicCache

    import unipg.policy.forward as forward
    import unipg.policy.generation as generation

    ids = prompts(policy.tokenizer, count=6)
    long = policy.sample(ids, max_new_tokens=20, temperature=1.0, generator=torch.Generator().manual_seed(5))
    stop = next(text[1] for text in long.texts if len(text) >= 2)  # one character = one token: rows end unevenly
    selections = []
    select = DynamicCache.batch_select_indices
    monkeypatch.setattr(
        DynamicCache,
        "batch_select_indices",
        lambda self, indices: selections.append(len(indices)) or select(self, indices),
    )
    compacted = policy.sample(
        ids, max_new_tokens=20, temperature=1.0, stop=[stop], generator=torch.Generator().manual_seed(6)
    )
    assert selections and min(selections) < len(ids)  # finished rows left the batch
    assert len(set(compacted.completion_lengths.tolist())) > 1
    for module in (forward, generation):  # no row selection: every row to the end
        monkeypatch.setattr(module, "plain_cache", lambda cache: False)
    full = policy.sample(
        ids, max_new_tokens=20, temperature=1.0, stop=[stop], generator=torch.Generator().manual_seed(6)
    )
    assert torch.equal(full.completion_ids, compacted.completion_ids) and full.texts == compacted.texts
    assert torch.allclose(full.behaviour_logprobs, compacted.behaviour_logprobs, atol=1e-4)
