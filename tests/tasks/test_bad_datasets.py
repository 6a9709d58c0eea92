"""Bad user data for a task: every problem is reported with the file, the line or row, and what was expected."""

import json

import pytest
from typer.testing import CliRunner

from unipg.cli import app
from unipg.tasks.base import make_task

GOOD = {"question": "Tom has 3 apples and buys 4 more. How many does he have?", "answer": "3 + 4 = 7\n#### 7"}


def jsonl(tmp_path, *lines: bytes | str | dict, name: str = "data.jsonl"):
    path = tmp_path / name
    encoded = [
        line if isinstance(line, bytes) else (json.dumps(line) if isinstance(line, dict) else line).encode()
        for line in lines
    ]
    path.write_bytes(b"".join(line + b"\n" for line in encoded))
    return path


def load_error(path, **options) -> str:
    with pytest.raises(ValueError) as error:
        make_task("gsm8k", path=str(path), **options)
    return str(error.value)


def test_a_missing_field_names_the_field_and_the_fields_found(tmp_path):
    path = jsonl(tmp_path, GOOD, {"prompt": "2+2?", "answer": "#### 4"})
    message = load_error(path)
    assert f"{path}, line 2: missing or non-text field 'question'" in message
    assert "fields found: 'prompt', 'answer'" in message


def test_a_missing_parquet_column_names_the_columns_found(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "data.parquet"
    parquet.write_table(pyarrow.table({"prompt": ["a", "b"], "answer": ["#### 1", "#### 2"]}), path)
    assert "lacks the column(s) question; expected 'question' and 'answer', found prompt, answer" in load_error(path)


@pytest.mark.parametrize(
    "record, expected",
    [
        ({"question": "   ", "answer": "#### 1"}, "line 2: field 'question' is empty"),
        ({"question": "Why?", "answer": ""}, "line 2: field 'answer' is empty"),
        (
            {"question": 12, "answer": "#### 1"},
            "line 2: missing or non-text field 'question': it holds int 12, not text",
        ),
        ({"question": "q", "answer": ["#### 1"]}, "line 2: missing or non-text field 'answer': it holds list"),
        ({"question": "q", "answer": None}, "line 2: field 'answer' is null"),
        ({"question": None, "answer": "#### 1"}, "line 2: field 'question' is null; every example needs a question"),
        ({"question": "q", "answer": "3 + 4\n#### seven"}, "line 2: the final answer '#### seven' is not a number"),
        ({"question": "q", "answer": "#### 7 apples"}, "line 2: the final answer '#### 7 apples' is not a number"),
        ({"question": "q", "answer": "#### $"}, "line 2: the answer has no final line '#### <number>'"),
        ({"question": "q", "answer": "no final line"}, "line 2: the answer has no final line '#### <number>'"),
    ],
)
def test_empty_prompts_and_wrong_value_types_name_the_line(tmp_path, record, expected):
    assert expected in load_error(jsonl(tmp_path, GOOD, record))


@pytest.mark.parametrize("answer", ["#### 7", "#### -7", "#### 1,234", "#### $5", "#### 0.25", "#### 3/4", "#### 5."])
def test_numeric_final_answers_in_every_gsm8k_form_are_accepted(tmp_path, answer):
    task = make_task("gsm8k", path=str(jsonl(tmp_path, GOOD, {"question": "q", "answer": answer})))
    assert len(task.train + task.test) == 2


def test_a_null_question_is_not_reported_as_missing(tmp_path):
    message = load_error(jsonl(tmp_path, GOOD, {"question": None, "answer": "#### 4"}))
    assert "is null" in message and "fields found" not in message


def test_wrong_value_types_in_a_parquet_column_name_the_row(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "data.parquet"
    parquet.write_table(pyarrow.table({"question": ["a", None], "answer": ["#### 1", "#### 2"]}), path)
    assert f"{path}, row 2: field 'question' is null" in load_error(path)


def test_non_utf8_bytes_name_the_file_and_line(tmp_path):
    path = jsonl(tmp_path, GOOD, b'{"question": "caf\xe9?", "answer": "#### 1"}')
    assert f"{path}, line 2: not UTF-8 text (byte 0xe9 at column 18); save the file as UTF-8" in load_error(path)


def test_a_malformed_json_line_names_the_file_and_line(tmp_path):
    path = jsonl(tmp_path, GOOD, GOOD, '{"question": "q", "answer": "#### 1"', GOOD)
    message = load_error(path)
    assert f"{path}, line 3: " in message and 'expected one JSON object {"question": ...' in message
    assert "line 2: expected a JSON object, got list" in load_error(jsonl(tmp_path, GOOD, "[1, 2]"))


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
def test_an_empty_file_is_rejected(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    assert f"gsm8k: {path} holds no examples" in load_error(path)


def test_an_empty_or_broken_parquet_file_is_rejected(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    empty = tmp_path / "empty.parquet"
    parquet.write_table(
        pyarrow.table({"question": pyarrow.array([], pyarrow.string()), "answer": pyarrow.array([], pyarrow.string())}),
        empty,
    )
    assert f"{empty} holds no rows" in load_error(empty)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    assert f"cannot read {broken} as a parquet file" in load_error(broken)


def test_a_single_example_cannot_be_split_into_train_and_test(tmp_path):
    assert "holds a single example; a single file is split into train and test" in load_error(jsonl(tmp_path, GOOD))


def test_a_byte_order_mark_is_accepted(tmp_path):
    path = jsonl(tmp_path, b"\xef\xbb\xbf" + json.dumps(GOOD).encode(), GOOD)
    task = make_task("gsm8k", path=str(path), test_fraction=0.5)
    assert len(task.train) == len(task.test) == 1


@pytest.mark.parametrize(
    "options, expected",
    [
        ({"path": 3}, "task 'gsm8k': option 'path' must be str or None, got int 3"),
        ({"test_fraction": "half"}, "option 'test_fraction' must be float, got str 'half'"),
        ({"num_train": True}, "option 'num_train' must be int or None, got bool True"),
    ],
)
def test_option_values_of_the_wrong_type_are_named(options, expected):
    with pytest.raises(ValueError, match=expected.replace("(", r"\(")):
        make_task("gsm8k", **options)


def test_the_cli_reports_bad_data_in_one_line_and_writes_nothing(tmp_path):
    data = jsonl(tmp_path, GOOD, b"{broken", name="train.jsonl")
    runs = tmp_path / "runs"
    result = CliRunner().invoke(
        app, ["train", "task.name=gsm8k", f"task.options.path={data}", f"log.output_dir={runs}"]
    )
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.output.startswith(f"error: gsm8k: {data}, line 2: ") and result.output.count("\n") == 1
    assert not runs.exists()
