"""Packed passes attend segment by segment: the log-probs, values and every parameter's gradient equal the padded
path's, no dense mask is built, and the model's other passes are untouched."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.masking_utils import AttentionMaskInterface

from unipg.policy import packed as packed_module
from unipg.policy import segment_attention
from unipg.policy.forward import left_pad
from unipg.policy.lm import LMPolicy
from unipg.policy.packed import pack_rows, packed_forward
from unipg.policy.segment_attention import SEGMENT_ATTENTION, use_segment_attention

PROMPT_LENGTHS = (0, 9, 3, 7, 1)  # an empty prompt: its first completion token predicts nothing
COMPLETION_LENGTHS = (12, 1, 30, 4, 6)  # length-skewed, with a one-token completion


# Rows repeating three prompts, a group's rows apart as a token-balanced micro-batch may leave them (prompt of each row)
GROUPS = (1, 0, 1, 2, 0, 1, 2)
GROUP_COMPLETION_LENGTHS = (5, 1, 9, 3, 12, 1, 7)


def edge_batch(
    seed: int = 0, prompt_lengths=PROMPT_LENGTHS, completion_lengths=COMPLETION_LENGTHS, groups=None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(input_ids, attention_mask, completion_length) of left-padded prompts and right-padded completions; with
    ``groups``, row r repeats prompt ``groups[r]``."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(8, 90, (n,), generator=generator).tolist() for n in prompt_lengths]
    prompt_ids, prompt_mask = left_pad(prompts if groups is None else [prompts[g] for g in groups], 0)
    width = max(completion_lengths)
    ids = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    real = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for row, length in enumerate(completion_lengths):
        ids[row, :length] = torch.randint(8, 90, (length,), generator=generator)
        real[row, :length] = 1
    return torch.cat([prompt_ids, ids], 1), torch.cat([prompt_mask, real], 1), width


def predicted(attention_mask: torch.Tensor, width: int) -> torch.Tensor:
    """(B, C) the completion tokens that have a token before them in their row."""
    real = attention_mask[:, -width:].bool()
    real[0, 0] = False  # the empty prompt's first token
    return real


def loss_and_outputs(policy: LMPolicy, packed: bool, batch=None) -> tuple[dict, dict]:
    """Log-probs, entropy and values of ``batch`` (``edge_batch``'s) and the gradient of a loss on them, per
    parameter."""
    input_ids, attention_mask, width = batch or edge_batch()
    policy.packed = packed
    policy.zero_grad(set_to_none=True)
    out = policy.evaluate(input_ids, attention_mask, width, with_entropy=True, entropy_grad=True, with_values=True)
    weights = torch.randn((3, *out.logprobs.shape), generator=torch.Generator().manual_seed(1))
    weights = weights * (predicted(attention_mask, width) if batch is None else attention_mask[:, -width:].bool())
    (weights[0] * out.logprobs + weights[1] * out.entropy + weights[2] * out.values).sum().backward()
    grads = {name: p.grad.clone() for name, p in policy.named_parameters() if p.grad is not None}
    return {"logprobs": out.logprobs, "entropy": out.entropy, "values": out.values}, grads


def assert_packed_equals_padded(policy: LMPolicy, batch=None) -> None:
    padded, padded_grads = loss_and_outputs(policy, packed=False, batch=batch)
    packed, packed_grads = loss_and_outputs(policy, packed=True, batch=batch)
    real = predicted(*edge_batch()[1:]) if batch is None else batch[1][:, -batch[2] :].bool()
    for name, value in padded.items():
        assert torch.allclose(packed[name][real], value[real], atol=1e-5), name
    assert padded_grads.keys() == packed_grads.keys() and len(padded_grads) > 4
    for name, grad in padded_grads.items():
        assert torch.allclose(packed_grads[name], grad, atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize(
    "options",
    [{"value_head": True}, {"value_head": True, "lora_rank": 4}, {"value_head": True, "gradient_checkpointing": True}],
    ids=["plain", "lora", "checkpointed"],
)
def test_packed_outputs_and_every_gradient_equal_padded(tiny_policy, options):
    if options.get("lora_rank"):
        pytest.importorskip("peft")
    policy = tiny_policy(**options)
    assert_packed_equals_padded(policy)
    assert policy.model.config.get_text_config()._attn_implementation == SEGMENT_ATTENTION


@pytest.mark.parametrize(
    "options",
    [
        {"value_head": True},
        {"value_head": True, "lora_rank": 4},
        {"value_head": True, "gradient_checkpointing": True},
        {"critic": "embedded"},
    ],
    ids=["plain", "lora", "checkpointed", "critic"],
)
def test_rows_that_repeat_a_prompt_share_it_in_the_packed_row_with_the_padded_results(
    tiny_policy, embedded_path, options, monkeypatch
):
    if options.get("lora_rank"):
        pytest.importorskip("peft")
    if "critic" in options:
        options = {"critic": embedded_path}
    batch = edge_batch(2, (6, 2, 4), GROUP_COMPLETION_LENGTHS, GROUPS)
    packing = pack_rows(*batch, share_prompts=True)
    # one segment per prompt: 6 + (1 + 12), 2 + (5 + 9 + 1), 4 + (3 + 7) tokens, the repeats' prompts left out
    assert sorted(packing.boundaries.diff().tolist()) == [14, 17, 19]
    assert packing.input_ids.shape[1] == int(batch[1].sum()) - (6 + 2 * 2 + 4) == 50
    shared = []
    layout = packed_module._pack_shared_prompts
    monkeypatch.setattr(packed_module, "_pack_shared_prompts", lambda *args: shared.append(layout(*args)) or shared[-1])
    assert_packed_equals_padded(tiny_policy(**options), batch)
    assert shared and all(packing is not None for packing in shared)  # every packed pass shared the prompts


def test_a_shared_prompt_segment_attends_to_its_prompt_and_its_own_completion_within_the_window():
    branches = torch.tensor([0, 0, 1, 1, 2, 2, 2])
    mask = segment_attention.branch_mask(branches)
    assert mask[4].tolist() == [True, True, False, False, True, False, False]  # prompt, then itself
    assert mask[3].tolist() == [True, True, True, True, False, False, False]
    # positions 0 1 | 2 3 | 2 3 4: a window of 2 keeps the last two positions
    assert segment_attention.branch_mask(branches, 2)[6].tolist() == [False] * 5 + [True, True]


def test_packed_critic_values_and_gradients_equal_padded(tiny_policy, embedded_path):
    policy = tiny_policy(critic=embedded_path)
    assert_packed_equals_padded(policy)
    assert policy.critic.backbone.config._attn_implementation == SEGMENT_ATTENTION


def test_sliding_window_layers_attend_within_their_window():
    config = Qwen2Config(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        use_sliding_window=True,
        sliding_window=5,
        max_window_layers=1,  # layer 1 slides, layer 0 attends to everything
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    tokenizer = type("Tokenizer", (), {"pad_token_id": 0, "eos_token_id": 1})()
    assert_packed_equals_padded(LMPolicy(model, tokenizer, value_head=True))


def test_packed_pass_builds_no_mask_and_attends_without_one(tiny_policy, monkeypatch):
    policy = tiny_policy()
    masks, seen = [], []
    sdpa_mask = AttentionMaskInterface._global_mapping["sdpa"]
    monkeypatch.setitem(
        AttentionMaskInterface._global_mapping, "sdpa", lambda *a, **k: masks.append(1) or sdpa_mask(*a, **k)
    )
    attend = segment_attention.segment_attention
    monkeypatch.setattr(
        segment_attention,
        "segment_attention",
        lambda m, q, k, v, mask, **kw: seen.append(mask) or attend(m, q, k, v, mask, **kw),
    )
    monkeypatch.setitem(
        segment_attention.AttentionInterface._global_mapping, SEGMENT_ATTENTION, segment_attention.segment_attention
    )
    input_ids, attention_mask, width = edge_batch()
    packed_forward(policy.model, pack_rows(input_ids, attention_mask, width))
    layers = policy.model.config.num_hidden_layers
    assert masks == [] and seen == [None] * layers
    policy.evaluate(input_ids, attention_mask, width)  # a padded pass still gets sdpa's mask
    assert masks and len(seen) > layers


def test_segment_attention_leaves_padded_passes_and_generation_as_they_were(tiny_policy):
    policy = tiny_policy()
    input_ids, attention_mask, width = edge_batch()
    prompts = [[12, 40, 7], [30, 31, 32, 33, 34]]

    def outputs():
        with torch.no_grad():
            logprobs = policy.evaluate(input_ids, attention_mask, width).logprobs
        sampled = policy.sample(prompts, max_new_tokens=6, generator=torch.Generator().manual_seed(0))
        return logprobs, sampled.completion_ids, sampled.behaviour_logprobs

    before = outputs()
    assert use_segment_attention(policy.model)
    for old, new in zip(before, outputs()):
        assert torch.equal(old, new)


def test_attention_scores_packed_passes_cannot_reproduce_are_refused(tiny_policy):
    model = tiny_policy().model
    use_segment_attention(model)
    query = torch.zeros((1, 4, 6, 32))
    module = model.model.layers[0].self_attn
    boundaries = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="softcap.*max_tokens_per_micro_batch to null"):
        segment_attention.segment_attention(module, query, query, query, None, cu_seq_lens_q=boundaries, softcap=30.0)


def test_models_on_other_attention_keep_their_own_packed_path(tiny_policy):
    model = tiny_policy().model
    model.config._attn_implementation = "eager"
    assert not use_segment_attention(model)
    assert model.config._attn_implementation == "eager"
