"""Rewards: rule-based scores on hand-written cases, the weighted combination, async functions, reward models."""

from __future__ import annotations

import asyncio

import pytest

from unipg.registry import RegistryError
from unipg.tasks.rewards import symbolic as symbolic_module
from unipg.tasks.rewards.model import RewardModel
from unipg.tasks.rewards.rules import (
    REWARDS,
    CombinedReward,
    answers_equivalent,
    build_rewards,
)


def score(name: str, completions: list, answers: list | None = None, **options) -> list:
    columns = {} if answers is None else {"answer": answers}
    return REWARDS.get(name)(**options)([""] * len(completions), completions, **columns)


def test_exact_match_compares_the_final_answer_string():
    completions = ["so the answer is 85", "#### 1,234", "#### 85.0", "85", "nothing"]
    assert score("exact_match", completions, ["  85 ", "1234", "85", "86", "1"]) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_digits_gives_the_share_of_digit_places_that_agree_from_the_units_place():
    completions = ["143", "153", "#### 43", "1043", "-143", "no number", "14.3", "0"]
    assert score("digits", completions, ["143"] * 7 + ["0"]) == [1.0, 2 / 3, 2 / 3, 0.5, 0.0, 0.0, 0.0, 1.0]
    assert score("digits", ["12"], [None]) == [None]
    combined = build_rewards([{"name": "math"}, {"name": "digits", "weight": 0.5}])
    assert combined([""] * 2, ["143", "153"], answer=["143", "143"]).total == [1.5, pytest.approx(1 / 3)]


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("#### 0.5", "1/2", 1.0),
        ("the result is 1/2", "0.5", 1.0),
        ("  85 ", "85", 1.0),
        ("#### 85.0000000001", "85", 1.0),  # within the default tolerance
        ("#### 86", "85", 0.0),
        ("#### 1,234", "1234", 1.0),
        ("#### -12", "-12", 1.0),
        ("#### 12", "-12", 0.0),
        ("#### \\frac{3}{4}", "0.75", 1.0),  # needs the symbolic fallback
        ("I do not know", "3", 0.0),
        ("#### banana", "3", 0.0),
    ],
)
def test_math_reward_accepts_equivalent_forms_only(completion, answer, expected):
    assert score("math", [completion], [answer]) == [expected]


def test_integers_are_compared_exactly_and_tolerance_is_absolute():
    assert not answers_equivalent("123456789012345678", "123456789012345679")
    assert answers_equivalent("0.30000001", "0.3", tolerance=1e-6)
    assert not answers_equivalent("0.3001", "0.3", tolerance=1e-6)


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("so the answer is \\boxed{\\frac{3}{4}}.", "0.75", 1.0),
        ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\sqrt{2}/2", 1.0),
        ("\\boxed{1/\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}", 1.0),
        ("\\boxed{\\frac{1}{3}} and later 7", "1/3", 1.0),  # the boxed answer wins over the last number
        ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0),
        ("\\boxed{\\pi}", "3.14", 0.0),
        ("\\boxed{2^{3^{4}}}", "8", 0.0),  # a power tower: refused before any symbolic library sees it
    ],
)
def test_math_reward_reads_boxed_latex_answers_with_math_verify(completion, answer, expected):
    assert score("math", [completion], [answer]) == [expected]


def test_sympy_decides_where_math_verify_cannot_parse(monkeypatch):
    assert symbolic_module.math_verify_equal("@", "2") is None
    monkeypatch.setattr(symbolic_module, "math_verify_equal", lambda predicted, reference: None)
    assert symbolic_module.symbolic_equal("sqrt(4)", "2", 1e-6)
    assert not symbolic_module.symbolic_equal("sqrt(5)", "2", 1e-6)
    assert not symbolic_module.symbolic_equal("__import__('os')", "0", 1e-6)  # never handed to sympy's evaluator


def test_numbers_are_scored_on_the_event_loop_and_expressions_on_a_thread(monkeypatch):
    """Answers the fast path decides (integers, decimals) cost no thread per call; a LaTeX answer still waits on one."""
    from unipg.tasks.rewards import rules

    threaded = []

    async def in_thread(function, /, *args, **kwargs):
        threaded.append(args[1])
        return function(*args, **kwargs)

    monkeypatch.setattr(rules, "in_daemon_thread", in_thread)
    reward = REWARDS.get("math")()
    numbers = asyncio.run(reward.acall(["", ""], ["12", "0.50"], answer=["12", "0.5"]))
    latex = asyncio.run(reward.acall([""], [r"\boxed{\frac{1}{2}}"], answer=["0.5"]))
    assert (numbers, latex) == ([1.0, 1.0], [1.0])
    assert threaded == [[r"\boxed{\frac{1}{2}}"]]


def test_expressions_and_refusals():
    assert answers_equivalent("sqrt(4)", "2")
    assert answers_equivalent("(1+2)*3", "9")
    assert not answers_equivalent("sqrt(5)", "2")
    assert not answers_equivalent("__import__('os')", "0")  # never handed to sympy's evaluator
    assert not answers_equivalent("9**9**9**9", "1")


def test_rewards_read_conversational_completions():
    completion = [{"role": "assistant", "content": "Work... #### 42"}]
    two_turns = [
        {"role": "assistant", "content": "#### 1"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "#### 42"},
    ]
    assert score("math", [completion, two_turns], ["42", "42"]) == [1.0, 1.0]
    assert score("format", [completion, "#### 42 apples"]) == [1.0, 0.0]


def test_missing_reference_answer_is_not_applicable():
    assert score("math", ["#### 3", "#### 4"], [None, "4"]) == [None, 1.0]
    with pytest.raises(ValueError, match="needs an 'answer' column"):
        score("math", ["#### 3"])


def test_length_penalty_is_zero_then_linear_then_clipped():
    completions = ["x" * 10, "x" * 15, "x" * 20, "x" * 100]
    assert score("length", completions, max_length=10, penalty=2.0) == [0.0, -1.0, -2.0, -2.0]


def test_combined_reward_weights_and_not_applicable_samples():
    def only_first(prompts, completions, **columns):
        return [1.0, None, None]

    def second_and_first(prompts, completions, **columns):
        return [0.5, 2.0, None]

    combined = CombinedReward.from_callables([(only_first, 2.0), (second_and_first, 10.0)])
    result = combined(["p"] * 3, ["a", "b", "c"])
    assert result.total == [2.0 + 5.0, 20.0, 0.0]
    assert result.not_applicable == 1
    assert result.per_function == {"only_first": [1.0, None, None], "second_and_first": [0.5, 2.0, None]}
    assert result.means() == {"only_first": 1.0, "second_and_first": 1.25}


def test_build_rewards_passes_columns_and_options():
    combined = build_rewards([{"name": "math", "weight": 1.0}, {"name": "format", "weight": 0.1}])
    result = combined(["q", "q"], ["2 + 2 = 4\n#### 4", "it is 4"], answer=["4", "4"])
    assert result.total == pytest.approx([1.1, 1.0])
    assert combined.names == ["math", "format"]
    two_lengths = build_rewards(
        [{"name": "length", "options": {"max_length": 5}}, {"name": "length", "options": {"max_length": 50}}]
    )
    assert two_lengths.names == ["length", "length_2"]


def test_build_rewards_errors_name_the_reward_and_the_valid_choices():
    with pytest.raises(RegistryError, match="unknown reward 'maths'.*Valid names: .*exact_match.*format.*math"):
        build_rewards([{"name": "maths"}])
    with pytest.raises(ValueError, match="reward 'math' has no option 'tol'.*It accepts: tolerance"):
        build_rewards([{"name": "math", "options": {"tol": 0.1}}])
    with pytest.raises(ValueError, match="reward 'length' needs the option.*max_length"):
        build_rewards([{"name": "length"}])
    with pytest.raises(ValueError, match="reward 'math': weight must be a number"):
        build_rewards([{"name": "math", "weight": "high"}])


def test_async_reward_functions_are_awaited_concurrently():
    running = 0
    most_at_once = 0

    async def slow_judge(prompts, completions, **columns):
        nonlocal running, most_at_once
        running += 1
        most_at_once = max(most_at_once, running)
        await asyncio.sleep(0.01)
        running -= 1
        return [len(c) / 10 for c in completions]

    async def second_judge(prompts, completions, **columns):
        return await slow_judge(prompts, completions, **columns)

    def sync_judge(prompts, completions, **columns):
        return [1.0 for _ in completions]

    combined = CombinedReward.from_callables([(slow_judge, 1.0), (second_judge, 1.0), (sync_judge, 1.0)])
    assert combined(["p"], ["abc"]).total == pytest.approx([1.6])
    assert most_at_once == 2

    async def inside_a_loop():
        with pytest.raises(RuntimeError, match="acall"):
            combined(["p"], ["abc"])
        return await combined.acall(["p"], ["abc"])

    assert asyncio.run(inside_a_loop()).total == pytest.approx([1.6])


def test_wrong_length_and_failures_name_the_function():
    def too_short(prompts, completions, **columns):
        return [1.0]

    with pytest.raises(ValueError, match="'too_short' returned 1 values for 2 completions"):
        CombinedReward.from_callables([(too_short, 1.0)])(["p", "p"], ["a", "b"])

    def broken(prompts, completions, **columns):
        raise KeyError("judge offline")

    with pytest.raises(RuntimeError, match="reward function 'broken' failed: 'judge offline'"):
        CombinedReward.from_callables([(broken, 1.0)])(["p"], ["a"])

    async def broken_async(prompts, completions, **columns):
        raise ConnectionError("judge offline")

    with pytest.raises(RuntimeError, match="reward function 'broken_async' failed: judge offline"):
        CombinedReward.from_callables([(broken_async, 1.0)])(["p"], ["a"])


@pytest.fixture(scope="module")
def tiny_reward_model_path(tmp_path_factory):
    """A two-layer Llama sequence classifier and a word-level tokenizer (with eos, without pad), saved locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        LlamaConfig,
        LlamaForSequenceClassification,
        PreTrainedTokenizerFast,
    )

    words = ["[UNK]", "</s>", "what", "is", "2", "+", "?", "4", "5", "the", "answer", "####"]
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="</s>")
    config = LlamaConfig(
        vocab_size=len(words),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_labels=1,
    )
    path = tmp_path_factory.mktemp("tiny_reward_model")
    tokenizer.save_pretrained(path)
    LlamaForSequenceClassification(config).save_pretrained(path)
    return str(path)


def test_reward_model_scores_each_completion(tiny_reward_model_path):
    model = RewardModel(tiny_reward_model_path, batch_size=2)
    assert model.tokenizer.pad_token == "</s>" and model.model.config.pad_token_id == 1
    completions = [" the answer is 4", " 5", " #### 4 4 4 4 4", [{"role": "assistant", "content": " 4"}]]
    scores = model(["what is 2 + 2 ?"] * 4, completions, answer=["4"] * 4)
    assert len(scores) == 4 and all(isinstance(value, float) for value in scores)
    # batching and padding do not change a sample's score
    alone = model(["what is 2 + 2 ?"], [" 5"])
    assert alone[0] == pytest.approx(scores[1], abs=1e-4)
    combined = build_rewards([{"name": "reward_model", "options": {"path": tiny_reward_model_path}}])
    assert combined(["what is 2 + 2 ?"], [" 5"]).total == pytest.approx(alone, abs=1e-4)
    # conversations go through the chat template when the tokenizer has one
    model.tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    prompt, completion = [{"role": "user", "content": "what is 2 + 2 ?"}], [{"role": "assistant", "content": "5"}]
    conversation = model([prompt], [completion])
    assert conversation == pytest.approx(model.score(["what is 2 + 2 ? 5 "], add_special_tokens=False), abs=1e-4)


def test_a_reward_model_takes_the_runs_device_and_dtype_unless_its_entry_sets_them(tiny_reward_model_path):
    import torch

    from unipg.config import ConfigError, load_config
    from unipg.tasks.rewards.rules import reward_defaults

    defaults = reward_defaults(load_config(None, ["task.name=arithmetic", "device=auto", "dtype=bfloat16"]))
    ((_, model, _),) = build_rewards(
        [{"name": "reward_model", "options": {"path": tiny_reward_model_path}}], defaults=defaults
    ).functions
    assert model.model.dtype == torch.bfloat16 and model.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    ((_, own, _),) = build_rewards(
        [{"name": "reward_model", "options": {"path": tiny_reward_model_path, "device": "cpu", "dtype": "float32"}}],
        defaults=defaults,
    ).functions
    assert own.model.dtype == torch.float32 and own.device == torch.device("cpu")
    assert [name for name, _, _ in build_rewards([{"name": "format"}], defaults=defaults).functions] == ["format"]
    on_ray = reward_defaults(load_config(None, ["task.name=arithmetic", "device=auto", "backend=ray"]))
    assert on_ray["device"] == "cpu"  # sent to rollout workers, which may have no GPU
    with pytest.raises(ConfigError, match="device 'tpu' is not a device name"):
        RewardModel(tiny_reward_model_path, device="tpu")


def test_reward_model_bad_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="could not be loaded: .*; check the path"):
        RewardModel(str(tmp_path / "no_such_model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="could not be loaded: .*; check the path"):
        RewardModel(str(tmp_path / "empty"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"could not be loaded \(.+\); check the path"):
        RewardModel(str(broken))
