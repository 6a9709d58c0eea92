"""Constrained JSON decoding: which schemas are refused, and a grammar's mask on its own rows of a batch, whose
behaviour log-probs are those of the masked distribution."""

import asyncio
import json

import jsonschema
import pytest
import torch
import xgrammar

from unipg.inference import HFService, SamplingParams
from unipg.inference.structured import COMPACT, JSON_OBJECT_SCHEMA, RowGrammars, grammar_compiler, schema_problem

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "unit": {"enum": ["m", "s"]}},
    "required": ["ok", "unit"],
}
SCHEMA_TEXT = json.dumps(SCHEMA, sort_keys=True)


@pytest.fixture(scope="module")
def policy(tiny_policy):
    return tiny_policy()


def prompt(policy, text="What is 2+3?"):
    return policy.tokenizer(f"<|user|>{text}<|end|><|assistant|>")["input_ids"]


@pytest.mark.parametrize(
    "schema, phrase",
    [
        ({"type": "foo"}, 'Unsupported type "foo"'),
        ({"type": "string", "pattern": "[a-"}, "Unclosed '['"),
        ({"type": "integer", "minimum": 5, "maximum": 2}, "minimum greater than maximum"),
        ({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}, "'multipleOf' is not enforced"),
        ({"type": "array", "uniqueItems": True}, "'uniqueItems' is not enforced"),
        ({"allOf": [{"type": "string"}, {"enum": ["a"]}]}, "allOf"),
        ({"type": "string", "format": "phone"}, "string format 'phone'"),
        ({"type": "string", "pattern": "a+", "maxLength": 3}, "together with minLength or maxLength"),
    ],
)
def test_a_schema_the_grammar_library_refuses_or_would_not_enforce_has_its_reason(schema, phrase):
    problem = schema_problem(json.dumps(schema))
    assert problem is not None and phrase in problem, problem
    assert "/project/cpp" not in problem  # the library's source location is left out


def test_keywords_are_looked_for_in_schemas_not_in_property_names_or_data():
    schema = {
        "type": "object",
        "properties": {"contains": {"type": "string"}, "uniqueItems": {"enum": [{"multipleOf": 2}]}},
        "$defs": {"n": {"type": "integer"}},
    }
    assert schema_problem(json.dumps(schema)) is None
    nested = {"type": "object", "properties": {"a": {"items": {"type": "number", "multipleOf": 2}}}}
    assert "multipleOf" in schema_problem(json.dumps(nested))


def masked_logprobs(policy, context, tokens, schema, temperature, *, specials_masked=True):
    """log μ of each of ``tokens``: the policy's softmax(logits / T) renormalised over the tokens the schema's
    grammar allowed at that step (special tokens other than EOS left out, as the hf engine does, with
    ``specials_masked``), computed from one forward pass and a replay of the grammar."""
    with torch.no_grad():
        logits = policy.model(torch.tensor([context + tokens])).logits[0, len(context) - 1 : -1].float()
    vocab = logits.shape[-1]
    matcher = xgrammar.GrammarMatcher(
        grammar_compiler(policy.tokenizer, vocab, policy.eos_ids).compile_json_schema(schema, **COMPACT)
    )
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    specials = sorted(set(policy.tokenizer.all_special_ids) - set(policy.eos_ids)) if specials_masked else []
    expected = []
    for step, token in enumerate(tokens):
        matcher.fill_next_token_bitmask(bitmask)
        allowed = torch.tensor([bool((int(bitmask[0, i // 32]) >> (i % 32)) & 1) for i in range(vocab)])
        allowed[specials] = False
        log_dist = torch.log_softmax(logits[step] / temperature, -1)
        expected.append(float(log_dist[token] - torch.logsumexp(log_dist[allowed], -1)))
        assert matcher.accept_token(token)
    return torch.tensor(expected)


def test_a_grammar_masks_its_own_rows_and_their_logprobs_are_the_masked_distributions(policy):
    contexts = [prompt(policy), prompt(policy, "Say hi"), prompt(policy, "Units?")]
    schemas = [None, SCHEMA_TEXT, JSON_OBJECT_SCHEMA]
    generation = policy.sample(
        contexts,
        max_new_tokens=40,
        temperature=0.8,
        generator=torch.Generator().manual_seed(0),
        constraint=RowGrammars(policy.tokenizer, policy.model.config.vocab_size, policy.eos_ids, schemas),
    )
    lengths = generation.completion_lengths.tolist()
    tokens = [generation.completion_ids[row, : lengths[row]].tolist() for row in range(3)]
    reply = json.loads(generation.texts[1])
    jsonschema.validate(reply, SCHEMA)
    assert generation.finish_reasons[1] == "stop" and tokens[1][-1] in policy.eos_ids
    for row in (1, 2):
        expected = masked_logprobs(policy, contexts[row], tokens[row], schemas[row], 0.8)
        torch.testing.assert_close(generation.behaviour_logprobs[row, : lengths[row]], expected, atol=1e-4, rtol=0)
    with torch.no_grad():  # the unconstrained row beside them: the policy's own distribution, no mask
        logits = policy.model(torch.tensor([contexts[0] + tokens[0]])).logits[0, len(contexts[0]) - 1 : -1].float()
    own = torch.log_softmax(logits / 0.8, -1).gather(-1, torch.tensor(tokens[0])[:, None]).squeeze(-1)
    torch.testing.assert_close(generation.behaviour_logprobs[0, : lengths[0]], own, atol=1e-4, rtol=0)
    assert not generation.texts[0].startswith("{")  # an untrained policy writes no JSON by itself


def test_the_hf_engine_batches_a_constrained_request_with_unconstrained_ones(policy):
    service = HFService(policy, SamplingParams(), generator=torch.Generator().manual_seed(0), batch_wait=None)
    constrained = SamplingParams(json_schema=SCHEMA_TEXT)

    async def one(params):
        async with service.episode():
            return await service.generate(prompt(policy), max_new_tokens=30, params=params)

    async def both():
        async with service.running():
            return await asyncio.gather(one(None), one(constrained), one(None))

    _, shaped, _ = asyncio.run(both())
    assert service.batches == [3]  # one sampling call: the schema is per row, not per call
    jsonschema.validate(json.loads(shaped.text), SCHEMA)
    assert shaped.finish_reason == "stop" and shaped.ended_with_eos
