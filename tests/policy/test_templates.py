"""Stock chat templates, the prefix-stability check, and the training variant that replaces Qwen3's template."""

import warnings

import pytest

from unipg.policy.chat import TurnTemplate
from unipg.policy.embedded import build_tokenizer
from unipg.policy.loading import load_tokenizer
from unipg.policy.templates import (
    NAMES,
    STOCK,
    family_tokenizer,
    prefix_stability_problem,
    prepare_chat_template,
    read_template,
    resolve_chat_template,
)

QUESTION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]


def render(tokenizer, messages, **options):
    return tokenizer.apply_chat_template(messages, tokenize=False, **options)


@pytest.mark.parametrize(
    "family, prompt",
    [
        (
            "qwen2.5",
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n",
        ),
        ("qwen3", "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"),
        (
            "llama3.1",
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
            "Today Date: 26 Jul 2024\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n2+2?"
            "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
    ],
)
def test_stock_templates_render_prompts_as_the_released_models_expect(family, prompt):
    assert render(family_tokenizer(family), QUESTION, add_generation_prompt=True) == prompt


def test_qwen25_adds_its_default_system_prompt_and_tools_go_into_the_system_message():
    tokenizer = family_tokenizer("qwen2.5")
    assert render(tokenizer, QUESTION[1:]).startswith(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    )
    tools = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {}}}]
    with_tools = render(tokenizer, QUESTION, tools=tools)
    assert with_tools.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and '"name": "add"' in with_tools


@pytest.mark.parametrize("name", ["qwen2.5", "llama3.1", "llama3.2", "qwen3-training"])
def test_templates_that_only_append_pass_the_prefix_check(name):
    family = "qwen3" if name == "qwen3-training" else name
    assert prefix_stability_problem(family_tokenizer(family, read_template(name))) is None
    assert prefix_stability_problem(build_tokenizer()) is None  # the embedded model's


def test_qwen3s_stock_template_fails_the_check_it_rewrites_turns():
    tokenizer = family_tokenizer("qwen3")
    assert prefix_stability_problem(tokenizer) == "it does not show an assistant turn as written"
    turn = [*QUESTION, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"}]
    # its reasoning disappears once a new user message follows: k+1 turns do not continue k turns
    assert "<think>\nadd" in render(tokenizer, turn)
    assert "<think>\nadd" not in render(tokenizer, [*turn, {"role": "user", "content": "and 3+3?"}])


def test_qwen3_is_replaced_by_its_training_variant_with_a_warning_naming_both():
    tokenizer = family_tokenizer("qwen3")
    stock_prompt = render(tokenizer, QUESTION, add_generation_prompt=True)
    with pytest.warns(UserWarning, match="chat template of 'Qwen/Qwen3-0.6B'.*training variant 'qwen3-training'"):
        prepare_chat_template(tokenizer, model="Qwen/Qwen3-0.6B")
    assert tokenizer.chat_template == read_template("qwen3-training")
    assert render(tokenizer, QUESTION, add_generation_prompt=True) == stock_prompt  # the first prompt is unchanged
    turns = [*QUESTION, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"}]
    longer = [*turns, {"role": "user", "content": "and 3+3?"}]
    assert render(tokenizer, longer).startswith(render(tokenizer, turns))  # past reasoning is kept
    TurnTemplate(tokenizer)  # multi-turn rollouts accept it


def test_a_template_that_passes_is_left_alone_without_a_warning():
    tokenizer = family_tokenizer("llama3.1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prepare_chat_template(tokenizer)
    assert tokenizer.chat_template == read_template("llama3.1")


def test_model_chat_template_is_a_name_a_file_or_jinja_text(tmp_path):
    path = tmp_path / "mine.jinja"
    path.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert resolve_chat_template("llama3.2") == read_template("llama3.2")
    assert resolve_chat_template(str(path)) == path.read_text()
    assert resolve_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    with pytest.raises(ValueError, match="known template .*qwen2.5, qwen3, llama3.1, llama3.2, qwen3-training"):
        resolve_chat_template("qwen4")
    assert set(STOCK) < set(NAMES)


def test_the_override_applies_when_the_tokenizer_is_loaded(tmp_path):
    build_tokenizer().save_pretrained(tmp_path)
    tokenizer = load_tokenizer(str(tmp_path), chat_template="qwen2.5")
    assert tokenizer.chat_template == read_template("qwen2.5")
    with pytest.warns(UserWarning, match="training variant 'qwen3-training'"):
        assert load_tokenizer(str(tmp_path), chat_template="qwen3").chat_template == read_template("qwen3-training")


def test_a_template_that_rewrites_turns_without_a_known_variant_is_refused_with_the_fix():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{% if loop.last or m.role != 'assistant' %}"
        "<|{{ m.role }}|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )  # drops past answers
    prepare_chat_template(tokenizer)  # nothing known replaces it
    with pytest.raises(ValueError, match="rewrites earlier turns.*set model.chat_template"):
        TurnTemplate(tokenizer)
    TurnTemplate(tokenizer, multi_turn=False)  # single-turn episodes insert nothing: any template serves them
