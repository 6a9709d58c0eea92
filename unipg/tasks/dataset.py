"""``dataset``: any table of prompts and answers, loaded with Hugging Face ``datasets``.

``path`` is a local ``.jsonl``/``.json``/``.parquet``/``.csv``/``.arrow`` file, a folder of such files (one split
per file name, e.g. ``train.jsonl`` and ``test.jsonl``), a folder written by ``Dataset.save_to_disk``, or a hub
id (``openai/gsm8k``, with ``subset: main``) where a network is reachable::

    task:
      name: dataset
      options: {path: data/problems.jsonl, columns: {prompt: question, answer: solution}, test_size: 0.1}
      rewards: [{name: math}]

Each row becomes one example. Its ``prompt`` column holds the user message, or a conversation (a list of
``{role, content}`` messages); its ``answer`` column the reference answer; an optional ``solution`` column a
demonstration for SFT (default: the answer). ``columns`` maps these names (and any other) to the dataset's own
column names. Every column but the prompt reaches the reward functions as a keyword argument of the same name,
as TRL's ``GRPOTrainer`` hands dataset columns to its reward functions: a reward ``def difficulty_bonus(prompts,
completions, level, **columns)`` reads the ``level`` column.

The test split is ``test_split`` when given, else ``test_size`` rows (a fraction or a count) drawn from ``split``
with ``data_seed``, else the dataset's own ``test`` split when it has one, else 10 % of ``split``. The validation
split, which training decisions read (``unipg.tasks.base``), is ``validation_split`` when given, else the
dataset's own ``validation`` split when it has one (and it is neither ``split`` nor the test split), else it is
carved out of the train rows by ``make_task``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from unipg.tasks.base import TASKS, Example, Task, _check_sizes

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
_ROLES = ("prompt", "answer", "solution")  # the columns a task reads itself; the rest go to rewards only


@TASKS.register("dataset")
def dataset_task(
    path: str,
    split: str = "train",
    test_split: str | None = None,
    validation_split: str | None = None,
    test_size: float | int | None = None,
    columns: dict | None = None,
    subset: str | None = None,
    num_train: int | None = None,
    num_test: int | None = None,
    data_seed: int = 1234,
) -> Task:
    """Examples from the table at ``path`` (module docstring); ``num_train`` and ``num_test`` cap the splits."""
    _check_sizes("dataset", num_train=num_train, num_test=num_test)
    renames = _column_map(columns)
    train_rows, validation_rows, test_rows = load_splits(
        path,
        split=split,
        test_split=test_split,
        validation_split=validation_split,
        test_size=test_size,
        subset=subset,
        data_seed=data_seed,
    )
    train = rows_to_examples(train_rows[:num_train], renames, f"dataset '{path}' split '{split}'")
    test = rows_to_examples(test_rows[:num_test], renames, f"dataset '{path}' test split")
    validation = None
    if validation_rows is not None:
        validation = rows_to_examples(validation_rows, renames, f"dataset '{path}' validation split")
    return Task(
        name="dataset",
        train=train,
        test=test,
        system_prompt=None,
        rewards=[{"name": "math", "weight": 1.0}],
        validation=validation,
    )


def _column_map(columns: Any) -> dict[str, str]:
    """``columns`` as {name the task and rewards see: the dataset's column}."""
    if columns is None:
        return {}
    if not isinstance(columns, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in columns.items()):
        raise ValueError(
            f"dataset: columns must map names to the dataset's column names, e.g. {{prompt: question, "
            f"answer: solution}}; got {columns!r}"
        )
    return dict(columns)


def load_splits(
    path: str,
    *,
    split: str,
    test_split: str | None,
    test_size: float | int | None,
    subset: str | None,
    data_seed: int,
    validation_split: str | None = None,
) -> tuple[list[dict], list[dict] | None, list[dict]]:
    """(train rows, validation rows or None when the dataset has none, test rows) as lists of dicts (module
    docstring: which split is which)."""
    import datasets

    datasets.disable_progress_bars()
    local = Path(path).expanduser()
    with tempfile.TemporaryDirectory(prefix="unipg-dataset-") as cache:  # a local file's arrow copy is temporary
        loaded = _load(datasets, local, path, subset, cache)
        if isinstance(loaded, datasets.Dataset):
            loaded = datasets.DatasetDict({split: loaded})
        if split not in loaded:
            raise ValueError(f"dataset '{path}' has no split '{split}'; its splits: {', '.join(loaded)}")
        if test_split is not None:
            if test_split not in loaded:
                raise ValueError(
                    f"dataset '{path}' has no split '{test_split}' (test_split); its splits: {', '.join(loaded)}"
                )
            train, test = loaded[split].to_list(), loaded[test_split].to_list()
        elif test_size is None and "test" in loaded and split != "test":
            train, test = loaded[split].to_list(), loaded["test"].to_list()
            test_split = "test"
        else:
            train, test = _split_off(loaded[split], 0.1 if test_size is None else test_size, data_seed, path)
        validation = _validation_rows(loaded, path, validation_split, taken=(split, test_split))
        return train, validation, test


def _validation_rows(loaded, path: str, validation_split: str | None, *, taken: tuple) -> list[dict] | None:
    """The rows of ``validation_split``, else of the dataset's own ``validation`` split unless a split of ``taken``
    (train's, test's) is it; None when there is none."""
    if validation_split is None:
        return loaded["validation"].to_list() if "validation" in loaded and "validation" not in taken else None
    if validation_split not in loaded:
        raise ValueError(
            f"dataset '{path}' has no split '{validation_split}' (validation_split); its splits: {', '.join(loaded)}"
        )
    if validation_split in taken:
        raise ValueError(
            f"dataset '{path}': validation_split '{validation_split}' is also the train or the test split; "
            "name a split of its own, or leave validation_split out to carve one out of train"
        )
    return loaded[validation_split].to_list()


def _load(datasets, local: Path, path: str, subset: str | None, cache: str):
    try:
        if local.is_dir() and any((local / name).is_file() for name in ("dataset_dict.json", "state.json")):
            return datasets.load_from_disk(str(local))
        if local.is_file():
            builder = _BUILDERS.get(local.suffix.lower())
            if builder is None:
                raise ValueError(
                    f"dataset: cannot read '{local}'; expected one of {', '.join(_BUILDERS)} files, a "
                    "folder of them, a save_to_disk folder or a hub id"
                )
            return datasets.load_dataset(builder, data_files=str(local), cache_dir=cache)
        if local.is_dir():
            return datasets.load_dataset(str(local), cache_dir=cache)
        if path.startswith((".", "/", "~")) or local.suffix.lower() in _BUILDERS:
            raise ValueError(f"dataset: path '{path}' does not exist; pass a data file, a folder, or a hub id")
        return datasets.load_dataset(path, subset)  # a hub id: downloaded into the user's cache
    except ValueError:
        raise
    except Exception as error:  # datasets raises many kinds (DatasetNotFoundError, ArrowInvalid, OSError, ...)
        first = (str(error).strip().splitlines() or [""])[0]
        raise ValueError(f"dataset: cannot load '{path}': {type(error).__name__}: {first}") from None


def _split_off(table, test_size: float | int, data_seed: int, path: str) -> tuple[list[dict], list[dict]]:
    """A seeded random split of ``table`` into (train, test), ``test_size`` a fraction in (0, 1) or a count."""
    fraction = isinstance(test_size, float)
    if (fraction and not 0.0 < test_size < 1.0) or (not fraction and not 0 < test_size < len(table)):
        raise ValueError(
            f"dataset '{path}': test_size must be a fraction in (0, 1) or a count in 1..{len(table) - 1} "
            f"(the split has {len(table)} rows), got {test_size!r}"
        )
    parts = table.train_test_split(test_size=test_size, seed=data_seed)
    return parts["train"].to_list(), parts["test"].to_list()


def rows_to_examples(rows: list[dict], renames: dict[str, str], where: str) -> list[Example]:
    """One Example per row; a missing column or an unusable prompt is a ValueError that says which and lists the
    columns present."""
    if not rows:
        return []
    present = list(rows[0])
    wanted = {"prompt": "prompt", "answer": "answer", **renames}  # name seen by the task and rewards -> column
    missing = [
        f"'{source}'" + (f" (columns.{name})" if source != name else "")
        for name, source in wanted.items()
        if source not in present
    ]
    if missing:
        raise ValueError(
            f"{where} lacks the column(s) {', '.join(missing)}; its columns: {', '.join(present)}. "
            "Name the right ones with task.options.columns, e.g. {prompt: question, answer: solution}"
        )
    taken = set(renames.values())
    examples = []
    for index, row in enumerate(rows):
        named = {name: row[source] for name, source in renames.items()}
        named.update({name: value for name, value in row.items() if name not in taken and name not in named})
        prompt = _prompt(named["prompt"], index, where)
        answer = "" if named["answer"] is None else str(named["answer"])
        solution = named.get("solution")
        columns = {name: value for name, value in named.items() if name not in ("prompt", "solution")}
        columns["answer"] = answer
        examples.append(Example(prompt, answer, answer if solution is None else solution, columns))
    return examples


def _prompt(value: Any, index: int, where: str) -> str | list[dict]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise ValueError(
        f"{where}, row {index}: the prompt must be text or a list of chat messages ({{role, content}}), "
        f"got {type(value).__name__} {str(value)[:60]!r}"
    )
