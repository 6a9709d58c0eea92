"""Log-probs, entropy and Σπ² taken from the final hidden states a chunk of tokens at a time equal those of the
whole logits, with their gradients (the policy padded and packed, the reference, SFT; temperature ≠ 1); a critic
computes no logits; and the memory held during a forward and backward pass stays below the whole logits'."""

import pytest
import torch
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from tests.helpers.batches import skewed_batch
from tests.helpers.memory import PeakTensorBytes
from unipg.policy import lm as policy_module
from unipg.policy.embedded import build_tokenizer
from unipg.policy.forward import positions
from unipg.policy.lm import CriticModel, LMPolicy
from unipg.policy.loading import load_causal_lm
from unipg.policy.token_logprobs import LogitHead, logit_head, token_statistics

TEMPERATURE = 0.7
CHUNK = 5  # tokens per chunk: several chunks in every batch below, the last one short
TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}
# a parameter's gradient sums over every token of the batch, chunk by chunk here and at once in the whole-logits
# pass: float32 sums in another order, whose rounding depends on the CPU's vector width (1.1e-5 seen on one machine)
GRADIENT_TOLERANCE = {"atol": 5e-5, "rtol": 1e-4}


def whole_logits_statistics(logits: torch.Tensor, targets: torch.Tensor, temperature: float = TEMPERATURE):
    """(log-probs, entropy, Σπ²) of softmax(logits / temperature), the whole (..., V) logits at once."""
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    logprobs = log_probs.gather(-1, targets[..., None]).squeeze(-1)
    return logprobs, -(log_probs.exp() * log_probs).sum(-1), (2 * log_probs).exp().sum(-1)


def completion_logits(model, batch) -> torch.Tensor:
    """(B, C, V) the model's own logits that predict each completion token, from one plain forward pass."""
    mask = batch.attention_mask
    out = model(input_ids=batch.input_ids, attention_mask=mask, position_ids=positions(mask), use_cache=False)
    return out.logits[:, -batch.completion_length - 1 : -1]


def predicted(batch) -> torch.Tensor:
    """(B, C) completion tokens that have a token before them in their row (those a packed pass predicts)."""
    width = batch.completion_length
    return batch.attention_mask[:, -width:].bool() & (positions(batch.attention_mask)[:, -width:] > 0)


def batches():
    skewed = skewed_batch()
    return {"distinct prompts": skewed, "shared prompts": skewed.rows(torch.tensor([0, 0, 2, 2, 4, 4]))}


@pytest.fixture(scope="module")
def policy(tiny_policy):
    return tiny_policy(reference="copy", needs_reference=True)


@pytest.mark.parametrize("head", ["plain", "bias, scale and soft cap"])
def test_chunked_statistics_equal_the_whole_logits_with_their_gradients(head):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn((3, 7, 8), generator=generator).requires_grad_()
    targets = torch.randint(0, 50, (3, 7), generator=generator)
    linear = torch.nn.Linear(8, 50, bias=head != "plain")
    logit_of = LogitHead(linear) if head == "plain" else LogitHead(linear, scale=2.5, softcap=3.0)
    weights = torch.randn((2, 3, 7), generator=generator)
    inputs = [hidden, *linear.parameters()]

    logprobs, entropy, sum_pi_squared = whole_logits_statistics(logit_of(hidden), targets)
    expected = torch.autograd.grad((weights[0] * logprobs + weights[1] * entropy).sum(), inputs)
    got = token_statistics(
        hidden,
        logit_of,
        targets,
        temperature=TEMPERATURE,
        chunk_tokens=CHUNK,
        with_entropy=True,
        entropy_grad=True,
        with_sum_pi_squared=True,
    )
    gradients = torch.autograd.grad((weights[0] * got.logprobs + weights[1] * got.entropy).sum(), inputs)
    torch.testing.assert_close(got.logprobs, logprobs.detach(), **TOLERANCE)
    torch.testing.assert_close(got.entropy, entropy.detach(), **TOLERANCE)
    torch.testing.assert_close(got.sum_pi_squared, sum_pi_squared.detach(), **TOLERANCE)
    for expected_gradient, gradient in zip(expected, gradients):
        torch.testing.assert_close(gradient, expected_gradient, **GRADIENT_TOLERANCE)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("name", ["distinct prompts", "shared prompts"])
def test_policy_logprobs_and_entropy_equal_the_whole_logits_with_their_gradients(policy, packed, name):
    batch = batches()[name]
    real = predicted(batch)
    weights = torch.randn((2, *real.shape), generator=torch.Generator().manual_seed(1)) * real
    parameters = policy.actor_parameters()
    targets = batch.input_ids[:, -batch.completion_length :]
    logprobs, entropy, _ = whole_logits_statistics(completion_logits(policy.model, batch), targets)
    expected = torch.autograd.grad((weights[0] * logprobs + weights[1] * entropy).sum(), parameters)

    policy.logits_chunk_tokens, policy.packed = CHUNK, packed
    try:
        out = policy.evaluate(
            batch.input_ids,
            batch.attention_mask,
            batch.completion_length,
            temperature=TEMPERATURE,
            with_entropy=True,
            entropy_grad=True,
        )
    finally:
        policy.logits_chunk_tokens, policy.packed = None, False
    gradients = torch.autograd.grad((weights[0] * out.logprobs + weights[1] * out.entropy).sum(), parameters)
    torch.testing.assert_close(out.logprobs[real], logprobs[real].detach(), **TOLERANCE)
    torch.testing.assert_close(out.entropy[real], entropy[real].detach(), **TOLERANCE)
    for expected_gradient, gradient in zip(expected, gradients):
        torch.testing.assert_close(gradient, expected_gradient, **GRADIENT_TOLERANCE)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_reference_logprobs_and_sum_pi_squared_equal_the_whole_logits(policy, packed):
    batch = batches()["shared prompts"]
    real = predicted(batch)
    targets = batch.input_ids[:, -batch.completion_length :]
    with torch.no_grad():
        reference, _, _ = whole_logits_statistics(completion_logits(policy.reference_model, batch), targets)
        _, _, sum_pi_squared = whole_logits_statistics(completion_logits(policy.model, batch), targets)
    policy.logits_chunk_tokens, policy.packed = CHUNK, packed
    try:
        arguments = (batch.input_ids, batch.attention_mask, batch.completion_length)
        got_reference = policy.reference_logprobs(*arguments, temperature=TEMPERATURE)
        got_sum_pi_squared = policy.sum_pi_squared(*arguments, temperature=TEMPERATURE)
    finally:
        policy.logits_chunk_tokens, policy.packed = None, False
    torch.testing.assert_close(got_reference[real], reference[real], **TOLERANCE)
    torch.testing.assert_close(got_sum_pi_squared[real], sum_pi_squared[real], **TOLERANCE)


def test_a_model_without_a_logit_head_falls_back_to_its_own_logits(policy, monkeypatch):
    batch = batches()["distinct prompts"]
    real = predicted(batch)
    arguments = (batch.input_ids, batch.attention_mask, batch.completion_length)
    with torch.no_grad():
        expected = policy.evaluate(*arguments, temperature=TEMPERATURE, with_entropy=True)
        monkeypatch.setattr(policy_module, "logit_head", lambda model: None)
        policy.logits_chunk_tokens = CHUNK
        try:
            got = policy.evaluate(*arguments, temperature=TEMPERATURE, with_entropy=True)
        finally:
            policy.logits_chunk_tokens = None
    torch.testing.assert_close(got.logprobs[real], expected.logprobs[real], **TOLERANCE)
    torch.testing.assert_close(got.entropy[real], expected.entropy[real], **TOLERANCE)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_critic_never_runs_the_lm_head(embedded_path, packed):
    torch.manual_seed(0)
    critic = CriticModel(load_causal_lm(embedded_path))
    batch = batches()["shared prompts"]
    calls = []
    critic.backbone.get_output_embeddings().register_forward_hook(lambda *call: calls.append(call))
    values = critic(batch.input_ids, batch.attention_mask, batch.completion_length, packed=packed)
    assert calls == []
    mask = batch.attention_mask
    with torch.no_grad():
        out = critic.backbone(
            input_ids=batch.input_ids, attention_mask=mask, position_ids=positions(mask), output_hidden_states=True
        )
        expected = critic.head(out.hidden_states[-1][:, -batch.completion_length - 1 : -1])
    real = predicted(batch)
    torch.testing.assert_close(values[real].detach(), expected[real], **TOLERANCE)


TINY = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
)
ARCHITECTURES = {
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**TINY)),
    "gemma2 (final soft cap)": (Gemma2ForCausalLM, Gemma2Config(**TINY, head_dim=8, final_logit_softcapping=2.0)),
    "granite (logits_scaling)": (GraniteForCausalLM, GraniteConfig(**TINY, logits_scaling=4.0)),
    "cohere (logit_scale)": (CohereForCausalLM, CohereConfig(**TINY, logit_scale=0.25)),
}


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_the_logit_head_reproduces_the_models_logits(architecture):
    model_class, config = ARCHITECTURES[architecture]
    torch.manual_seed(0)
    model = model_class(config).eval()
    input_ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=input_ids, output_hidden_states=True)
        head = logit_head(model)
        torch.testing.assert_close(head(out.hidden_states[-1]), out.logits, **TOLERANCE)
        assert head.softcap is not None or head.scale != 1.0 or architecture == "qwen2"  # each one recognised


class CheckpointCodeModel(Qwen2ForCausalLM):
    """Stands in for a model whose code comes with its checkpoint: a class from outside transformers."""


def test_a_model_from_its_own_code_keeps_its_own_logits_and_a_sharded_one_does_not():
    config = ARCHITECTURES["qwen2"][1]
    assert logit_head(CheckpointCodeModel(config)) is None
    # fully_shard swaps a model's class for a subclass it defines in torch's own modules
    sharded = type("FSDPQwen2ForCausalLM", (Qwen2ForCausalLM,), {"__module__": "torch.distributed.fsdp._fsdp_init"})
    assert logit_head(sharded(config)) is not None and logit_head(Qwen2ForCausalLM(config)) is not None


def test_a_model_whose_config_changes_its_logits_otherwise_keeps_its_own_logits():
    config = Qwen2Config(**TINY, lm_head_multiplier=2.0)  # Falcon-H1 multiplies its logits by this
    assert logit_head(Qwen2ForCausalLM(config)) is None


LARGE_VOCABULARY = 50_000
ROWS, PROMPT, COMPLETION = 4, 4, 64  # 256 completion tokens: whole float32 logits of 51 MB


def large_vocabulary_policy() -> LMPolicy:
    """One small layer of hidden size 16 under a 50k-token vocabulary: the logits dwarf everything else."""
    torch.manual_seed(0)
    config = Qwen2Config(**{**TINY, "vocab_size": LARGE_VOCABULARY})
    return LMPolicy(Qwen2ForCausalLM(config).eval(), build_tokenizer())


def peak_bytes_of_a_training_pass(policy: LMPolicy, chunk_tokens: int | None) -> int:
    """Peak bytes of tensors alive during a forward and backward pass of log-probs and entropy."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(8, 90, (ROWS, PROMPT + COMPLETION), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    policy.logits_chunk_tokens = chunk_tokens
    with PeakTensorBytes() as memory:
        out = policy.evaluate(input_ids, attention_mask, COMPLETION, with_entropy=True, entropy_grad=True)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        del out
    return memory.peak


def test_the_memory_of_a_chunked_pass_stays_below_the_whole_logits():
    policy = large_vocabulary_policy()
    whole_logits = ROWS * COMPLETION * LARGE_VOCABULARY * 4  # float32
    whole = peak_bytes_of_a_training_pass(policy, None)
    chunked = peak_bytes_of_a_training_pass(policy, 16)
    assert whole > whole_logits  # the measure sees the logits (and what autograd keeps of them)
    assert chunked < whole_logits, (chunked, whole_logits)  # measured: 27 MB at 16 tokens a chunk, 324 MB whole
