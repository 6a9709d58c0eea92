"""The validation split: drawn from the train side, disjoint from train and test, deterministic by data_seed, the
same for every task (a plugin's too), and read by no one who reads the test split."""

from __future__ import annotations

import json

import pytest

from unipg.config import ConfigError, load_config
from unipg.sample.episodes import build_task
from unipg.tasks.base import TASKS, VALIDATION_EXAMPLES, Example, Task, make_task, validation_size, with_validation


def prompts(examples: list[Example]) -> list[str]:
    return [json.dumps(example.prompt) for example in examples]


def disjoint(task: Task) -> bool:
    train, validation, test = (set(prompts(split)) for split in (task.train, task.validation, task.test))
    return not (train & validation or validation & test or train & test)


@pytest.mark.parametrize(
    "name, options",
    [
        ("arithmetic", {"digits": 2, "num_train": 300, "num_test": 40}),
        ("calculator", {"digits": 2, "num_train": 300, "num_test": 40}),
        ("units", {"digits": 2, "num_train": 300, "num_test": 40}),
        ("gsm8k", {"num_train": 300, "num_test": 40}),
        ("solver_checker", {"digits": 2, "num_train": 300, "num_test": 40}),
    ],
)
def test_a_built_in_task_gives_up_a_tenth_of_train_and_leaves_test_alone(name, options):
    task = make_task(name, **options)
    whole = make_task(name, **options, validation_examples=0)  # the task as its factory builds it
    assert (len(task.train), len(task.validation), len(task.test)) == (270, 30, 40) and disjoint(task)
    assert task.test == whole.test and whole.validation == []
    carved = set(prompts(task.validation))
    assert prompts(task.train) == [p for p in prompts(whole.train) if p not in carved]  # train keeps its order
    assert make_task(name, **options).validation == task.validation  # deterministic
    assert make_task(name, **options, data_seed=99).validation != task.validation


def test_the_size_is_a_tenth_of_train_capped_and_at_least_one_or_as_asked():
    assert [validation_size(count, None) for count in (0, 1, 2, 19, 20, 1000, 5000)] == [0, 0, 1, 1, 2, 100, 128]
    assert VALIDATION_EXAMPLES == 128 and validation_size(5000, 7) == 7
    assert len(make_task("calculator").validation) == 128  # of the default 5000
    assert len(make_task("arithmetic", digits=1, num_train=40, num_test=8, validation_examples=5).validation) == 5
    with pytest.raises(ValueError, match=r"validation_examples \(40\) would take every one of its 40"):
        make_task("arithmetic", digits=1, num_train=40, num_test=8, validation_examples=40)
    with pytest.raises(ValueError, match="validation_examples must be a non-negative integer"):
        make_task("arithmetic", digits=1, num_train=40, num_test=8, validation_examples=-1)


def test_an_sft_stage_carves_the_same_problems_as_the_run_it_warms_up():
    """A stage rebuilds the task with other demonstrations, not other problems: it must not train on the run's
    validation problems."""
    run = make_task("calculator", digits=2, num_train=200, num_test=20, tool_demonstrations=0.1)
    stage = make_task("calculator", digits=2, num_train=200, num_test=20, tool_demonstrations=1.0)
    assert [e.prompt for e in stage.validation] == [e.prompt for e in run.validation]
    assert all(len(e.solution) == 3 for e in stage.validation)  # the stage's own demonstrations, all with the tool


@pytest.fixture
def registered(monkeypatch):
    """Register tasks for one test only."""
    monkeypatch.setattr(TASKS, "_entries", dict(TASKS._entries))
    return TASKS.register


def words_task(name: str, count: int, *, own: list[Example] | None = None) -> Task:
    examples = [Example(f"word {i}", str(i), str(i), {"answer": str(i)}) for i in range(count)]
    return Task(name, examples[:-4], examples[-4:], None, [{"name": "math"}], validation=own)


def test_a_plugin_task_without_a_validation_split_gets_one_carved_by_its_data_seed(registered):
    @registered("seeded_words")
    def seeded_words(num: int) -> Task:
        return words_task("seeded_words", num)

    @registered("words_with_seed")
    def words_with_seed(data_seed: int = 3) -> Task:
        return words_task("words_with_seed", 64)

    task = make_task("seeded_words", num=64)  # no data_seed option: carved with seed 0
    assert (len(task.train), len(task.validation), len(task.test)) == (54, 6, 4) and disjoint(task)
    assert make_task("seeded_words", num=64).validation == task.validation
    seeded = make_task("words_with_seed")
    assert seeded.validation == make_task("words_with_seed", data_seed=3).validation  # its default is its seed
    assert seeded.validation != make_task("words_with_seed", data_seed=4).validation
    assert len(make_task("seeded_words", num=5).validation) == 0  # one train example: nothing to spare


def test_a_task_with_its_own_validation_split_keeps_it_cut_to_the_size_asked(registered):
    own = [Example(f"held {i}", str(i), str(i), {"answer": str(i)}) for i in range(200)]
    registered("own_split")(lambda: words_task("own_split", 40, own=own))
    task = make_task("own_split")
    assert len(task.train) == 36 and task.validation == own[:VALIDATION_EXAMPLES]
    assert make_task("own_split", validation_examples=10).validation == own[:10]


def test_a_run_builds_its_task_with_eval_validation_examples_and_carves_a_task_handed_to_it():
    config = load_config(
        None,
        ["task.name=arithmetic", "task.options={digits: 1, num_train: 40, num_test: 8}", "eval.validation_examples=6"],
    )
    assert len(build_task(config).validation) == 6
    handed = TASKS.get("arithmetic")(digits=1, num_train=40, num_test=8)
    assert handed.validation is None and len(build_task(config, handed).validation) == 6
    assert with_validation(build_task(config), size=6).validation == build_task(config).validation  # idempotent
    with pytest.raises(ConfigError, match="validation_examples"):
        load_config(None, ["task.name=arithmetic", "eval.validation_examples=-1"])


datasets = pytest.importorskip("datasets")


def rows(start: int, count: int) -> list[dict]:
    return [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(start, start + count)]


def test_a_dataset_uses_its_own_validation_split_or_the_one_named_else_carves_one(tmp_path):
    splits = {"train": rows(0, 30), "validation": rows(30, 5), "dev": rows(35, 3), "test": rows(38, 6)}
    datasets.DatasetDict({name: datasets.Dataset.from_list(r) for name, r in splits.items()}).save_to_disk(
        tmp_path / "saved"
    )
    path = str(tmp_path / "saved")
    task = make_task("dataset", path=path)
    assert (len(task.train), len(task.validation), len(task.test)) == (30, 5, 6) and disjoint(task)
    assert [e.prompt for e in task.validation] == [row["prompt"] for row in splits["validation"]]
    dev = make_task("dataset", path=path, validation_split="dev")
    assert [e.prompt for e in dev.validation] == [row["prompt"] for row in splits["dev"]]
    as_test = make_task("dataset", path=path, test_split="validation")  # a split that tests does not validate too
    assert len(as_test.train) + len(as_test.validation) == 30 and disjoint(as_test)
    with pytest.raises(ValueError, match="has no split 'held' \\(validation_split\\); its splits: train"):
        make_task("dataset", path=path, validation_split="held")
    with pytest.raises(ValueError, match="validation_split 'test' is also the train or the test split"):
        make_task("dataset", path=path, validation_split="test")
    (tmp_path / "plain.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows(0, 40)))
    carved = make_task("dataset", path=str(tmp_path / "plain.jsonl"), test_size=10)
    assert (len(carved.train), len(carved.validation), len(carved.test)) == (27, 3, 10) and disjoint(carved)
