import json
import string
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from unipg.policy import embedded
from unipg.policy.embedded import (
    BUILDER_VERSION,
    EMBEDDED_SIZES,
    MARKER_FILE,
    build_embedded,
    build_model,
    build_tokenizer,
    cache_dir,
    embedded_folder_name,
    embedded_model_path,
    resolve_model_name,
)
from unipg.policy.loading import load_tokenizer

SPECIALS = ["<pad>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<unk>"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    """No test may write to the real cache in the home folder."""
    monkeypatch.setenv("UNIPG_CACHE", str(tmp_path / "cache"))


def test_printable_text_round_trips_one_token_per_character(tokenizer):
    text = string.printable.replace("\t", "").replace("\r", "").replace("\x0b", "").replace("\x0c", "")
    text += "  double  spaces ,. and\nnew lines\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text


def test_special_tokens_are_single_tokens_never_split(tokenizer):
    assert tokenizer.convert_tokens_to_ids(SPECIALS) == list(range(len(SPECIALS)))
    assert tokenizer.pad_token_id == 0 and tokenizer.eos_token == "<|end|>" and tokenizer.unk_token == "<unk>"
    ids = tokenizer.encode("a<|user|>b<|end|>", add_special_tokens=False)
    assert ids == [tokenizer.convert_tokens_to_ids(t) for t in ["a", "<|user|>", "b", "<|end|>"]]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "ab"
    assert tokenizer.padding_side == "right"


def test_chat_template_renders_compact_turns(tokenizer):
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "37+48="}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|user|>37+48=<|end|><|assistant|>"
    assert len(tokenizer.encode(rendered, add_special_tokens=False)) == 9
    conversation = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
        {"role": "tool", "content": "T"},
    ]
    assert tokenizer.apply_chat_template(conversation, tokenize=False) == (
        "<|system|>S<|end|><|user|>U<|end|><|assistant|>A<|end|><|tool|>T<|end|>"
    )


def test_tiny_model_is_a_seeded_qwen2_of_about_a_million_parameters(tokenizer):
    model = build_model(tokenizer)
    assert type(model).__name__ == "Qwen2ForCausalLM" and not model.training
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 3e6
    assert model.config.vocab_size == len(tokenizer) and model.config.tie_word_embeddings
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    torch.manual_seed(123)
    expected_next_draw = torch.rand(1)
    torch.manual_seed(123)
    same = build_model(tokenizer, seed=0)
    assert torch.rand(1) == expected_next_draw, "building a model must not consume the global RNG"
    other = build_model(tokenizer, seed=1)
    weight = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(model.state_dict()[weight], same.state_dict()[weight])
    assert not torch.equal(model.state_dict()[weight], other.state_dict()[weight])


def test_unknown_size_lists_the_valid_ones(tokenizer):
    with pytest.raises(ValueError, match="valid sizes: \\['small', 'tiny', 'tiny-numbers'\\]"):
        build_model(tokenizer, size="huge")
    with pytest.raises(ValueError, match="'embedded:small'"):
        resolve_model_name("embedded:huge")
    assert {"tiny", "small"} <= set(EMBEDDED_SIZES)


def test_built_folder_loads_like_a_hub_model_with_identical_logits(tmp_path, tokenizer):
    path = embedded_model_path(root=tmp_path)
    assert path.parent == tmp_path and f"v{BUILDER_VERSION}" in path.name and "tiny" in path.name
    marker = json.loads((path / MARKER_FILE).read_text())
    assert marker == {"builder_version": BUILDER_VERSION, "size": "tiny", "seed": 0}
    assert (path / "model.safetensors").is_file()
    loaded_model = AutoModelForCausalLM.from_pretrained(path)
    loaded_tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = "<|user|>37+48=<|end|><|assistant|>"
    assert loaded_tokenizer.encode(prompt, add_special_tokens=False) == tokenizer.encode(
        prompt, add_special_tokens=False
    )
    assert loaded_tokenizer.chat_template == tokenizer.chat_template
    input_ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        torch.testing.assert_close(
            loaded_model(input_ids).logits, build_model(tokenizer)(input_ids).logits, rtol=0, atol=0
        )


def test_second_call_reuses_the_build(tmp_path, monkeypatch):
    path = embedded_model_path(root=tmp_path)
    builds = []
    monkeypatch.setattr(embedded, "build_embedded", lambda *args: builds.append(args))
    assert embedded_model_path(root=tmp_path) == path
    assert builds == []


def test_concurrent_builds_leave_one_complete_folder(tmp_path):
    target = tmp_path / "embedded-v1-tiny-seed0"
    first = build_embedded(target, "tiny", 0)
    marker_time = (first / MARKER_FILE).stat().st_mtime_ns
    # A second builder that started before the first finished: its rename loses, and it keeps the winner.
    second = build_embedded(target, "tiny", 0)
    assert first == second and (second / MARKER_FILE).stat().st_mtime_ns == marker_time
    assert [entry.name for entry in tmp_path.iterdir()] == [target.name], "staging folders must be removed"
    AutoModelForCausalLM.from_pretrained(target)


def test_simultaneous_builders_agree_on_one_folder(tmp_path):
    with ThreadPoolExecutor(max_workers=2) as pool:
        paths = list(pool.map(lambda _: embedded_model_path(root=tmp_path), range(2)))
    assert paths[0] == paths[1] and (paths[0] / MARKER_FILE).is_file()
    assert [entry.name for entry in tmp_path.iterdir()] == [paths[0].name]


def test_incomplete_folder_is_reported_not_loaded(tmp_path):
    (tmp_path / embedded_folder_name("tiny", 0)).mkdir()
    with pytest.raises(RuntimeError, match="delete the folder"):
        embedded_model_path(root=tmp_path)


def test_resolve_model_name_builds_in_the_cache_and_passes_other_names_through(tmp_path):
    assert cache_dir() == tmp_path / "cache"
    resolved = resolve_model_name("embedded")
    assert resolved == str(tmp_path / "cache" / f"embedded-v{BUILDER_VERSION}-tiny-seed0")
    assert (tmp_path / "cache" / f"embedded-v{BUILDER_VERSION}-tiny-seed0" / MARKER_FILE).is_file()
    assert resolve_model_name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert resolve_model_name("/models/local") == "/models/local"


def test_cache_dir_defaults_to_the_home_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("UNIPG_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "unipg"


def test_saved_tokenizer_loads_back_character_for_character(embedded_path, tmp_path):
    from unipg.policy.loading import load_tokenizer

    text = '<|user|>What is 3 * 4?\nA {"x": 1}<|end|>'
    for folder in (embedded_path, tmp_path / "again"):
        tokenizer = load_tokenizer(str(folder))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text and len(ids) == len(text) - len("<|user|><|end|>") + 2
        tokenizer.save_pretrained(tmp_path / "again")  # a saved policy's tokenizer keeps the flag


def test_numbers_tokenizer_reads_digits_in_groups_of_three_and_round_trips(tmp_path):
    tokenizer = build_tokenizer("numbers")
    text = "<|tool|>53336<|end|><|assistant|>Convert 1234567 km, 0.5 m<|end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids)[:4] == ["<|tool|>", "533", "36", "<|end|>"]
    assert "123" in tokenizer.convert_ids_to_tokens(ids) and "7" in tokenizer.convert_ids_to_tokens(ids)
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_tokens_to_ids(["<pad>", "<|end|>"]) == [0, 1]  # the same special ids as "tiny"
    path = embedded_model_path("tiny-numbers", root=tmp_path)
    assert load_tokenizer(str(path)).encode(text, add_special_tokens=False) == ids
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.vocab_size == len(tokenizer) == len(build_tokenizer()) + 1100
    with torch.no_grad():  # numbers share part of their embedding (they are alike), letters nothing
        table = torch.nn.functional.normalize(model.get_input_embeddings().weight, dim=1)
        numbers = table[tokenizer.convert_tokens_to_ids([str(value) for value in range(100, 1000)])]
        letters = table[tokenizer.convert_tokens_to_ids(list(string.ascii_lowercase))]
        assert 0.1 < float(mean_pairwise_cosine(numbers)) < 0.5
        assert abs(float(mean_pairwise_cosine(letters))) < 0.05
    with pytest.raises(ValueError, match="numbers must be 'characters' or 'numbers'"):
        build_tokenizer("bytes")


def mean_pairwise_cosine(rows: torch.Tensor) -> torch.Tensor:
    """The mean cosine between distinct rows of unit vectors."""
    similarity, count = rows @ rows.T, len(rows)
    return (similarity.sum() - similarity.diagonal().sum()) / (count * (count - 1))
