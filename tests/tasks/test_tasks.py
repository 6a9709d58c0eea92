"""Tasks: correct answers, disjoint and reproducible splits, the GSM8K loader and its error messages."""

from __future__ import annotations

import json
import re

import pytest

from unipg.registry import RegistryError
from unipg.tasks.answers import extract_final_answer
from unipg.tasks.base import TASKS, make_task


def test_arithmetic_answers_are_the_value_of_the_expression():
    task = make_task("arithmetic", digits=3, operations="+-*", num_train=500, num_test=100)
    for example in task.train + task.test:
        left, operation, right = re.fullmatch(r"(\d+)([+\-*])(\d+)=", example.prompt).groups()
        assert len(left) <= 3 and len(right) <= 3
        expected = {"+": int(left) + int(right), "-": int(left) - int(right), "*": int(left) * int(right)}
        assert example.answer == str(expected[operation])
        assert example.solution == example.answer  # the completion is just the number
        assert example.columns == {"answer": example.answer}
    assert any(example.answer.startswith("-") for example in task.train)  # subtraction may go negative
    assert task.rewards == [{"name": "math", "weight": 1.0}]


def test_arithmetic_splits_are_disjoint_distinct_and_reproducible():
    task = make_task("arithmetic", digits=2, num_train=3000, num_test=200, data_seed=7)
    train_prompts = [example.prompt for example in task.train + task.validation]  # the validation split is carved
    test_prompts = [example.prompt for example in task.test]
    assert len(set(train_prompts)) == 3000 and len(set(test_prompts)) == 200
    assert not set(train_prompts) & set(test_prompts)
    again = make_task("arithmetic", digits=2, num_train=3000, num_test=200, data_seed=7)
    assert again.train == task.train and again.test == task.test
    other_seed = make_task("arithmetic", digits=2, num_train=3000, num_test=200, data_seed=8)
    assert other_seed.test != task.test
    # the test set does not move when the train set grows
    assert make_task("arithmetic", digits=2, num_train=10, num_test=200, data_seed=7).test == task.test


def test_arithmetic_can_use_the_whole_problem_space_and_no_more():
    task = make_task("arithmetic", digits=1, operations="+", num_train=90, num_test=10)
    assert len({example.prompt for example in task.train + task.validation + task.test}) == 100
    with pytest.raises(ValueError, match="only 100 distinct problems"):
        make_task("arithmetic", digits=1, operations="+", num_train=91, num_test=10)
    # by default the train set takes 20000 problems, or all that the test set leaves (the validation split included)
    kept = lambda task: len(task.train) + len(task.validation)  # noqa: E731
    assert kept(make_task("arithmetic", digits=1, operations="+", num_test=30)) == 70
    default = make_task("arithmetic")
    assert (kept(default), len(default.validation), len(default.test)) == (19800, 128, 200)
    assert kept(make_task("arithmetic", digits=3, num_test=10)) == 20000


def test_unknown_task_and_option_names_are_reported():
    with pytest.raises(RegistryError, match="arithmetic"):
        make_task("arithmetc")
    with pytest.raises(ValueError, match="did you mean 'digits'.*It accepts: digits, operations"):
        make_task("arithmetic", digit=3)
    with pytest.raises(ValueError, match="operations"):
        make_task("arithmetic", operations="+/")
    assert {"arithmetic", "gsm8k"} <= set(TASKS.names())


@pytest.mark.parametrize(
    "text, expected",
    [
        ("She pays 3 * 4 = <<3*4=12>>12.\n#### 1,234", "1234"),
        ("#### 72.", "72"),
        ("first #### 5 then #### -7\nThanks!", "-7"),
        ("The total is 12 apples, so 3/4 of them is 9.", "9"),
        ("half is 3/4", "3/4"),
        ("it drops to -2.5 degrees", "-2.5"),
        ("It costs $1,000,000 in all", "1000000"),
        ("no numbers here", None),
        ("so x = \\boxed{\\frac{1}{2}}, not 7", "\\frac{1}{2}"),
        ("\\boxed{3} first, then \\boxed{ $\\sqrt{x^{2}}$ }.", "\\sqrt{x^{2}}"),
        ("an unclosed \\boxed{4 and #### 5", "5"),
        ("<answer>3</answer> no, <answer> blue whale </answer>", "blue whale"),
        ("</answer> 7 <answer>", "7"),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def test_generated_word_problems_read_like_gsm8k_and_answer_themselves():
    task = make_task("gsm8k", num_train=300, num_test=50, data_seed=3, validation_examples=0)
    assert len(task.train) == 300 and len(task.test) == 50
    assert not {e.prompt for e in task.train} & {e.prompt for e in task.test}
    openings = set()
    for example in task.train + task.test:
        assert example.solution.splitlines()[-1] == f"#### {example.answer}"
        assert extract_final_answer(example.solution) == example.answer == example.columns["answer"]
        int(example.answer)  # integer answers
        for expression, value in re.findall(r"<<([^=]+)=(-?\d+)>>", example.solution):
            assert eval(expression) == int(value)  # every calculator annotation is right
        openings.add(" ".join(example.prompt.split()[1:3]))
    assert len(openings) >= 8  # many different templates appear
    assert make_task("gsm8k", num_train=300, num_test=50, data_seed=3, validation_examples=0).train == task.train
    assert task.rewards == [{"name": "math", "weight": 1.0}, {"name": "format", "weight": 0.1}]
    assert task.system_prompt is None


def _records(count: int) -> list[dict]:
    """GSM8K-style records whose answers carry thousands separators: "1,234" for i = 1."""
    records = []
    for i in range(1, count + 1):
        total = f"{i * 1000 + 234:,}"
        answer = f"{i}000 + 234 = {total}\n#### {total}"
        records.append({"question": f"What is {i} thousand plus 234?", "answer": answer})
    return records


def _write_jsonl(path, records) -> None:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def test_loader_reads_jsonl_splits_it_and_removes_thousands_separators(tmp_path):
    file = tmp_path / "gsm8k.jsonl"
    _write_jsonl(file, _records(20))
    task = make_task("gsm8k", path=str(file), test_fraction=0.25, data_seed=0, validation_examples=0)  # the loader's
    assert len(task.train) == 15 and len(task.test) == 5
    assert not {e.prompt for e in task.train} & {e.prompt for e in task.test}
    by_prompt = {e.prompt: e for e in task.train + task.test}
    example = by_prompt["What is 1 thousand plus 234?"]
    assert example.answer == "1234" and example.columns == {"answer": "1234"}
    assert example.solution.endswith("#### 1,234")
    again = make_task("gsm8k", path=str(file), test_fraction=0.25, data_seed=0)
    assert again.test == task.test
    capped = make_task(
        "gsm8k", path=str(file), test_fraction=0.25, data_seed=0, num_train=4, num_test=2, validation_examples=0
    )
    assert capped.train == task.train[:4] and capped.test == task.test[:2]


def test_loader_reads_parquet_and_the_hugging_face_directory_layout(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    folder = tmp_path / "gsm8k" / "main"
    folder.mkdir(parents=True)
    records = _records(12)
    parquet.write_table(pyarrow.Table.from_pylist(records[:8]), folder / "train-00000-of-00001.parquet")
    parquet.write_table(pyarrow.Table.from_pylist(records[8:]), folder / "test-00000-of-00001.parquet")
    task = make_task("gsm8k", path=str(tmp_path / "gsm8k"), validation_examples=0)  # the files' own splits
    assert [e.prompt for e in task.train] == [r["question"] for r in records[:8]]
    assert [e.answer for e in task.test] == [str(i * 1000 + 234) for i in range(9, 13)]
    single = make_task("gsm8k", path=str(folder / "train-00000-of-00001.parquet"), test_fraction=0.5)
    assert len(single.train) + len(single.validation) == len(single.test) == 4


def test_loader_reads_a_jsonl_directory(tmp_path):
    _write_jsonl(tmp_path / "train.jsonl", _records(3))
    _write_jsonl(tmp_path / "test.jsonl", _records(5)[3:])
    task = make_task("gsm8k", path=str(tmp_path), validation_examples=0)  # the files' own splits
    assert [e.answer for e in task.train] == ["1234", "2234", "3234"]
    assert [e.answer for e in task.test] == ["4234", "5234"]


def test_loader_errors_name_the_file_line_and_what_is_expected(tmp_path):
    file = tmp_path / "bad.jsonl"
    file.write_text(json.dumps(_records(1)[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 2: .*expected one JSON object"):
        make_task("gsm8k", path=str(file))
    file.write_text(json.dumps({"question": "q", "answer": "no final line"}) + "\n")
    with pytest.raises(ValueError, match=r"line 1: the answer has no final line '#### <number>'"):
        make_task("gsm8k", path=str(file))
    file.write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(ValueError, match=r"line 1: missing or non-text field 'answer'"):
        make_task("gsm8k", path=str(file))
    with pytest.raises(ValueError, match="does not exist"):
        make_task("gsm8k", path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="no test file"):
        _write_jsonl(tmp_path / "train.jsonl", _records(2))
        make_task("gsm8k", path=str(tmp_path))


@pytest.mark.parametrize(
    "name, options, expected",
    [
        (
            "calculator",
            {"digits": 1},
            r"calculator: digits=1 with operations='\*' gives only 100 distinct problems, "
            r"fewer than num_test = 200; lower num_test / num_train or raise digits",
        ),
        ("calculator", {"digits": 1, "num_test": 100}, "takes them all, leaving none to train on"),
        ("calculator", {"digits": 1, "num_test": 50, "num_train": 51}, "fewer than num_train \\+ num_test = 101"),
        ("arithmetic", {"digits": 1, "num_test": 1000}, "arithmetic: digits=1 .* fewer than num_test = 1000"),
        ("arithmetic", {"digits": 1, "operations": "+", "num_test": 100}, "leaving none to train on"),
        ("multihop", {"num_test": 10_000}, "multihop: the bundled world .* fewer than num_test = 10000"),
        ("multihop", {"num_test": 0, "num_train": 10_000}, "fewer than num_train \\+ num_test = 10000"),
    ],
)
def test_sizes_a_task_cannot_hold_name_the_options_to_change(name, options, expected):
    with pytest.raises(ValueError, match=expected):
        make_task(name, **options)


def test_a_task_that_fits_its_problem_space_exactly_is_built():
    task = make_task("calculator", digits=1, num_test=40)
    assert (len(task.train) + len(task.validation), len(task.test)) == (60, 40)
    assert len({example.prompt for example in task.train + task.validation + task.test}) == 100
