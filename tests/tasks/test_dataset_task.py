"""The `dataset` task: a user's table (jsonl, parquet, csv, a save_to_disk folder) with its own column names
trains, and its extra columns reach the reward functions by name."""

from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from tests.helpers.configs import DETERMINISTIC_PPO
from unipg.cli import app
from unipg.observe.metrics import read_metrics
from unipg.tasks.base import make_task
from unipg.tasks.rewards.combine import CombinedReward, RewardFunctionError

datasets = pytest.importorskip("datasets")


def arithmetic_rows(count: int = 200, seed: int = 0) -> list[dict]:
    """``count`` one-digit sums with the column names a user's own data might have."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        left, right = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"question": f"{left}+{right}=", "result": left + right, "carry": int(left + right > 9)})
    return rows


@pytest.fixture
def problems(tmp_path):
    path = tmp_path / "problems.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in arithmetic_rows()) + "\n", encoding="utf-8")
    return path


COLUMNS = {"prompt": "question", "answer": "result"}


def test_a_jsonl_with_its_own_column_names_gives_a_seeded_disjoint_split(problems):
    task = make_task("dataset", path=str(problems), columns=COLUMNS, test_size=0.1, data_seed=7)
    assert (len(task.train), len(task.validation), len(task.test)) == (162, 18, 20)  # validation carved from train
    first = task.train[0]
    assert first.prompt.endswith("=") and first.answer == str(eval(first.prompt[:-1]))
    assert first.columns == {"answer": first.answer, "carry": int(int(first.answer) > 9)}
    again = make_task("dataset", path=str(problems), columns=COLUMNS, test_size=0.1, data_seed=7)
    assert again.train == task.train and again.test == task.test
    other = make_task("dataset", path=str(problems), columns=COLUMNS, test_size=20, data_seed=8)
    assert len(other.test) == 20 and other.test != task.test
    ids = lambda examples: {id(e) for e in examples}  # noqa: E731
    assert not ids(task.train) & ids(task.test) and not ids(task.validation) & ids(task.train + task.test)
    worked = make_task("dataset", path=str(problems), columns={**COLUMNS, "solution": "question"}, test_size=0.1)
    assert worked.train[0].solution == worked.train[0].prompt  # the demonstration SFT trains on
    capped = make_task("dataset", path=str(problems), columns=COLUMNS, num_train=16, num_test=4)
    # no test split in the file: 10 % held out, then capped; a validation example carved out of the 16
    assert (len(capped.train), len(capped.validation), len(capped.test)) == (15, 1, 4)


def test_named_splits_parquet_csv_and_save_to_disk_folders(tmp_path):
    rows = [{"prompt": row["question"], "answer": row["result"]} for row in arithmetic_rows(40)]
    table = datasets.Dataset.from_list(rows)
    (tmp_path / "split").mkdir()
    datasets.Dataset.from_list(rows[:30]).to_json(tmp_path / "split" / "train.jsonl")
    datasets.Dataset.from_list(rows[30:]).to_json(tmp_path / "split" / "test.jsonl")
    folder = make_task("dataset", path=str(tmp_path / "split"))
    assert (len(folder.train) + len(folder.validation), len(folder.test)) == (30, 10)
    assert folder.test[0].prompt == rows[30]["prompt"]
    table.to_parquet(tmp_path / "data.parquet")
    table.to_csv(tmp_path / "data.csv", index=False)
    for name in ("data.parquet", "data.csv"):
        task = make_task("dataset", path=str(tmp_path / name), test_size=10)
        assert (len(task.train) + len(task.validation), len(task.test)) == (30, 10)
    datasets.DatasetDict({"train": table.select(range(35)), "validation": table.select(range(35, 40))}).save_to_disk(
        tmp_path / "saved"
    )
    saved = make_task("dataset", path=str(tmp_path / "saved"), test_split="validation")
    assert (len(saved.train) + len(saved.validation), len(saved.test)) == (35, 5)  # a split tests, not both


def test_a_prompt_column_of_chat_messages_is_kept_as_a_conversation(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [
        {
            "messages": [
                {"role": "system", "content": "Answer with a number."},
                {"role": "user", "content": f"{i}+1="},
            ],
            "answer": str(i + 1),
        }
        for i in range(10)
    ]
    path.write_text("\n".join(json.dumps(row) for row in rows), encoding="utf-8")
    task = make_task("dataset", path=str(path), columns={"prompt": "messages"}, test_size=2)
    assert task.train[0].prompt[0] == {"role": "system", "content": "Answer with a number."}
    assert task.train[0].prompt[1]["role"] == "user"


def test_errors_name_the_missing_column_and_list_those_present(problems, tmp_path):
    with pytest.raises(ValueError) as raised:
        make_task("dataset", path=str(problems), columns={"prompt": "question"})
    assert "lacks the column(s) 'answer'; its columns: question, result, carry" in str(raised.value)
    with pytest.raises(ValueError, match=r"lacks the column\(s\) 'query' \(columns.prompt\)"):
        make_task("dataset", path=str(problems), columns={"prompt": "query", "answer": "result"})
    with pytest.raises(ValueError, match="has no split 'dev' \\(test_split\\); its splits: train"):
        make_task("dataset", path=str(problems), columns=COLUMNS, test_split="dev")
    with pytest.raises(ValueError, match="path '.*missing.jsonl' does not exist"):
        make_task("dataset", path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="test_size must be a fraction in \\(0, 1\\) or a count in 1..199"):
        make_task("dataset", path=str(problems), columns=COLUMNS, test_size=200)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": 3, "answer": "3"}) + "\n" + json.dumps({"prompt": 4, "answer": "4"}))
    with pytest.raises(ValueError, match="the prompt must be text or a list of chat messages"):
        make_task("dataset", path=str(bad), test_size=1)


def test_extra_columns_reach_reward_functions_by_name(problems):
    """TRL's convention: a reward function with **kwargs gets every column; one without gets the columns it names,
    and one that needs a column the task lacks fails with the columns there are."""
    example = make_task("dataset", path=str(problems), columns=COLUMNS, test_size=0.1).train[0]
    columns = {name: [value] for name, value in example.columns.items()}

    def carry_bonus(prompts, completions, carry):
        return [0.5 * flag for flag in carry]

    def everything(prompts, completions, **kwargs):
        return [float(sorted(kwargs) == ["answer", "carry"])]

    scored = CombinedReward.from_callables([(carry_bonus, 1.0), (everything, 1.0)])(
        [example.prompt], [example.answer], **columns
    )
    assert scored.per_function == {"carry_bonus": [0.5 * example.columns["carry"]], "everything": [1.0]}

    def needs_level(prompts, completions, level):
        return [0.0]

    with pytest.raises(
        RewardFunctionError,
        match="'needs_level' needs the column\\(s\\) level, which the task does not have; its columns: answer, carry",
    ):
        CombinedReward.from_callables([(needs_level, 1.0)])([example.prompt], [example.answer], **columns)


@pytest.mark.e2e
def test_unipg_train_on_a_jsonl_with_custom_column_names(problems, embedded_path, tmp_path):
    """`unipg train task.name=dataset task.options.path=... task.options.columns=...` trains a few updates."""
    quick = [item for item in DETERMINISTIC_PPO if not item.startswith("task.")]
    result = CliRunner().invoke(
        app,
        [
            "train",
            "task.name=dataset",
            f"task.options.path={problems}",
            "task.options.columns={prompt: question, answer: result}",
            "task.options.num_test=4",
            *quick,
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path / 'runs'}",
        ],
    )
    assert result.exit_code == 0, result.output
    run_dir = next((tmp_path / "runs").iterdir())
    steps = [record for record in read_metrics(run_dir) if "train/loss" in record]
    assert [record["step"] for record in steps] == [1, 2, 3] and "rollout/reward_math" in steps[0]


def test_a_conversation_prompt_is_rendered_and_tokenised_once():
    """Prompts that are conversations go through the chat rendering like text prompts, cached by content."""
    from unipg.policy.embedded import build_tokenizer
    from unipg.sample.episodes import PromptEncoder

    tokenizer = build_tokenizer()
    encode = PromptEncoder(tokenizer, system_prompt=None, max_length=64)
    conversation = [{"role": "user", "content": "1+1="}]
    assert encode(conversation) == encode("1+1=")  # one user message renders as the text prompt does
    assert encode(list(conversation)) is encode(conversation)
