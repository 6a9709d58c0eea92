import copy

import pytest

from unipg.policy.chat import TurnTemplate, check_tokenizer, completion_suffix, render_prompt
from unipg.policy.embedded import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture
def base_tokenizer(tokenizer):
    """The same vocabulary without a chat template, like a base model's tokenizer."""
    without_template = copy.deepcopy(tokenizer)
    without_template.chat_template = None
    return without_template


def test_string_prompt_renders_as_a_user_turn_opening_the_assistant(tokenizer):
    assert render_prompt(tokenizer, "37+48=") == "<|user|>37+48=<|end|><|assistant|>"
    assert render_prompt(tokenizer, "37+48=", system_prompt="Add.") == (
        "<|system|>Add.<|end|><|user|>37+48=<|end|><|assistant|>"
    )


def test_message_list_is_rendered_as_given(tokenizer):
    messages = [
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "3+3="},
    ]
    assert render_prompt(tokenizer, messages) == (
        "<|user|>2+2=<|end|><|assistant|>4<|end|><|user|>3+3=<|end|><|assistant|>"
    )


def test_two_system_prompts_are_rejected(tokenizer):
    with pytest.raises(ValueError, match="keep only one"):
        render_prompt(
            tokenizer, [{"role": "system", "content": "A"}, {"role": "user", "content": "q"}], system_prompt="B"
        )


def test_without_a_template_contents_are_joined_by_newlines(base_tokenizer):
    assert render_prompt(base_tokenizer, "37+48=") == "37+48="
    assert render_prompt(base_tokenizer, "37+48=", system_prompt="Add.") == "Add.\n37+48="


def test_completion_suffix_is_the_eos_token(tokenizer, base_tokenizer):
    assert completion_suffix(tokenizer) == "<|end|>"
    no_eos = copy.deepcopy(base_tokenizer)
    no_eos.eos_token = None
    assert completion_suffix(no_eos) == ""


def test_check_tokenizer_falls_back_to_eos_for_padding(tokenizer):
    no_pad = copy.deepcopy(tokenizer)
    no_pad.pad_token = None
    assert check_tokenizer(no_pad, "m") is no_pad
    assert no_pad.pad_token == "<|end|>" and no_pad.pad_token_id == no_pad.eos_token_id
    assert check_tokenizer(tokenizer, "m").pad_token == "<pad>"


def test_check_tokenizer_without_pad_or_eos_says_how_to_fix(tokenizer):
    bare = copy.deepcopy(tokenizer)
    bare.pad_token = None
    bare.eos_token = None
    with pytest.raises(
        ValueError, match="tokenizer of 'my/model' has no pad token and no eos token; set tokenizer.pad_token"
    ):
        check_tokenizer(bare, "my/model")


def test_a_demonstration_turn_of_weight_zero_is_laid_out_but_not_trained(tokenizer):
    template = TurnTemplate(tokenizer, multi_turn=True)
    messages = [
        {"role": "assistant", "content": "The answer is 418.", "weight": 0},
        {"role": "user", "content": "REJECT: 408"},
        {"role": "assistant", "content": "408"},
    ]
    segments = template.demonstration(messages)
    trained = template.demonstration([{k: v for k, v in m.items() if k != "weight"} for m in messages])
    assert [text for text, _ in segments] == [text for text, _ in trained]  # the same tokens either way
    assert [flag for _, flag in segments] == [False, False, True]
    assert [flag for _, flag in trained] == [True, False, True]
    with pytest.raises(ValueError, match="weight is 0"):
        template.demonstration([{"role": "assistant", "content": "408", "weight": 0.5}])
