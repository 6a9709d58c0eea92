"""Tokenizers and models that lack something: a chat template, a pad token, an EOS token, context for a long
prompt. Each has a documented fallback or an error that says what to change, and nothing reaches the model as an
index error. The models are tiny GPT-2s built locally: learned position embeddings fail hard past their context."""

import warnings

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from typer.testing import CliRunner

from unipg.cli import app
from unipg.config import load_config
from unipg.policy.chat import TurnTemplate, render_agent_prompt, render_prompt
from unipg.policy.embedded import build_tokenizer
from unipg.policy.loading import load_lm_policy, load_tokenizer, policy_from_config
from unipg.sample.episodes import PromptEncoder

CONTEXT = 64  # positions of the tiny models


def save_tiny_model(folder, *, pad: bool = True, eos: bool = True, template: bool = True) -> str:
    """A folder like save_pretrained writes: a one-layer GPT-2 and the embedded character tokenizer."""
    tokenizer = build_tokenizer()
    if not pad:
        tokenizer.pad_token = None
    if not eos:
        tokenizer.eos_token = None
    if not template:
        tokenizer.chat_template = None
    config = GPT2Config(
        n_positions=CONTEXT,
        n_embd=16,
        n_layer=1,
        n_head=2,
        vocab_size=len(tokenizer),
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")
    kinds = {
        "complete": {},
        "no_pad": {"pad": False},
        "no_eos": {"eos": False},
        "no_template": {"template": False},
        "no_pad_no_eos": {"pad": False, "eos": False},
    }
    return {name: save_tiny_model(root / name, **options) for name, options in kinds.items()}


def text_config(model: str, *overrides: str):
    return load_config(None, ["task.name=arithmetic", "algorithm=dr_grpo", f"model.name={model}", *overrides])


def ids(tokenizer, length: int) -> list[int]:
    return tokenizer("7" * length, add_special_tokens=False)["input_ids"]


# --- chat template --------------------------------------------------------------------------------------------


def test_without_a_chat_template_prompts_are_plain_text(models):
    tokenizer = load_tokenizer(models["no_template"])
    assert not tokenizer.chat_template
    assert render_prompt(tokenizer, "2+2=", system_prompt="Add.") == "Add.\n2+2="
    template = TurnTemplate(tokenizer)
    assert template.closing(ended_with_eos=True) == "\n" and template.observation("4") == "4\n"
    tool = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "evaluates arithmetic",
            "parameters": {"properties": {"expression": {"type": "string"}}},
        },
    }
    rendered = render_agent_prompt(tokenizer, "2+2=", None, [tool])
    assert rendered.startswith("Tools (call one as <tool_call>") and rendered.endswith("\n2+2=")
    policy = load_lm_policy(models["no_template"])
    generation = policy.sample([tokenizer(rendered, add_special_tokens=False)["input_ids"][-32:]], max_new_tokens=4)
    assert generation.completion_lengths.item() >= 1


# --- pad and eos tokens ---------------------------------------------------------------------------------------


def test_a_missing_pad_token_falls_back_to_eos(models):
    tokenizer = load_tokenizer(models["no_pad"])
    assert tokenizer.pad_token == tokenizer.eos_token == "<|end|>"
    policy = load_lm_policy(models["no_pad"])
    assert policy.pad_id == tokenizer.eos_token_id
    generation = policy.sample([ids(tokenizer, 3), ids(tokenizer, 9)], max_new_tokens=4)
    assert generation.prompt_mask[0].tolist() == [0] * 6 + [1] * 3  # left padding is masked, whatever its id


def test_no_pad_and_no_eos_token_is_an_error_that_says_what_to_set(models):
    with pytest.raises(
        ValueError,
        match=r"has no pad token and no eos token; set tokenizer.pad_token \(for a saved "
        r"model: \"pad_token\" in its tokenizer_config.json",
    ):
        load_tokenizer(models["no_pad_no_eos"])


def test_a_missing_eos_token_warns_and_completions_run_to_max_new_tokens(models):
    with pytest.warns(
        UserWarning,
        match=r"has no EOS token, so every completion runs to sample.max_new_tokens; "
        r"set sample.stop",
    ):
        policy = policy_from_config(text_config(models["no_eos"], "sample.max_new_tokens=8"))
    generation = policy.sample([ids(policy.tokenizer, 5)] * 3, max_new_tokens=6)
    assert generation.completion_lengths.tolist() == [6, 6, 6] and set(generation.finish_reasons) == {"length"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # stop strings end completions: no warning
        policy_from_config(text_config(models["no_eos"], "sample.max_new_tokens=8", "sample.stop=[END]"))


# --- the context window ---------------------------------------------------------------------------------------


def test_a_completion_budget_as_long_as_the_context_is_rejected_at_load_time(models):
    with pytest.raises(
        ValueError,
        match=rf"sample.max_new_tokens \({CONTEXT}\) leaves no room for a prompt in the "
        rf"{CONTEXT}-token context of model '.*complete'; lower it below {CONTEXT}",
    ):
        policy_from_config(text_config(models["complete"], f"sample.max_new_tokens={CONTEXT}"))


def test_generation_stops_where_the_context_ends_and_training_reads_it_back(models):
    policy = load_lm_policy(models["no_eos"])  # no EOS: every row runs until its own limit
    assert policy.context_length == CONTEXT
    generation = policy.sample(
        [ids(policy.tokenizer, CONTEXT - 4), ids(policy.tokenizer, 5)],
        max_new_tokens=16,
        generator=torch.Generator().manual_seed(0),
    )
    assert generation.completion_lengths.tolist() == [4, 16]
    assert generation.finish_reasons == ["length", "length"]
    full_ids = torch.cat([generation.prompt_ids, generation.completion_ids], dim=1)  # wider than the context
    full_mask = torch.cat([generation.prompt_mask, generation.completion_mask], dim=1)
    logprobs = policy.evaluate(full_ids, full_mask, generation.completion_ids.shape[1]).logprobs
    valid = generation.completion_mask.bool()
    assert torch.allclose(logprobs[valid], generation.behaviour_logprobs[valid], atol=1e-4)


def test_a_prompt_that_fills_the_context_is_an_error_not_an_index_error(models):
    policy = load_lm_policy(models["complete"])
    with pytest.raises(
        ValueError,
        match=rf"a prompt of {CONTEXT} tokens leaves no room for a completion in the "
        rf"model's {CONTEXT}-token context; lower sample.max_prompt_length below",
    ):
        policy.sample([ids(policy.tokenizer, 3), ids(policy.tokenizer, CONTEXT)], max_new_tokens=2)
    too_long = torch.ones((1, CONTEXT + 8), dtype=torch.long)
    with pytest.raises(ValueError, match=rf"a sequence of {CONTEXT + 8} tokens \(prompt \+ completion\) exceeds"):
        policy.evaluate(too_long, too_long, 4)


def test_long_prompts_keep_their_last_max_prompt_length_tokens():
    tokenizer = build_tokenizer()
    prompt = "".join(str(index % 10) for index in range(100))  # 100 tokens, one per character
    kept = PromptEncoder(tokenizer, system_prompt=None, max_length=16)(prompt)
    assert tokenizer.decode(kept) == "67890123456789<|end|><|assistant|>"  # the end of the question survives


def test_cli_rejects_a_budget_the_model_cannot_hold_before_writing_anything(models, tmp_path):
    result = CliRunner().invoke(
        app,
        [
            "train",
            "task.name=arithmetic",
            "algorithm=dr_grpo",
            f"model.name={models['complete']}",
            "sample.max_new_tokens=100",
            f"log.output_dir={tmp_path / 'runs'}",
        ],
    )
    assert result.exit_code == 2 and "Traceback" not in result.output
    error_lines = [line for line in result.output.splitlines() if line.startswith("error: ")]  # after progress bars
    assert len(error_lines) == 1 and "sample.max_new_tokens (100) leaves no room for a prompt" in error_lines[0]
    assert not (tmp_path / "runs").exists()
