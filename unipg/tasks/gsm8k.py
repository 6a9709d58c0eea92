"""``gsm8k``: grade-school math word problems in the GSM8K format (worked steps ending in ``#### <number>``),
either generated from templates (no files needed) or read from the real GSM8K ``.jsonl``/``.parquet`` files."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path
from typing import Callable

from unipg.tasks.answers import extract_final_answer
from unipg.tasks.base import TASKS, Example, Task, _check_sizes


@TASKS.register("gsm8k")
def gsm8k_task(
    path: str | None = None,
    num_train: int | None = None,
    num_test: int | None = None,
    data_seed: int = 1234,
    test_fraction: float = 0.1,
) -> Task:
    """Grade-school math word problems; the answer text ends in ``#### <number>``.

    Without ``path``, generated from templates: ``num_train`` (default 2000) and ``num_test`` (default 200)
    distinct problems. With ``path``, read from the real GSM8K files (see ``load_gsm8k``); ``num_train`` and
    ``num_test`` then cap the split sizes, and None keeps every example.
    """
    _check_sizes("gsm8k", num_train=num_train, num_test=num_test)
    if path is None:
        train_count = 2000 if num_train is None else num_train
        test_count = 200 if num_test is None else num_test
        train, test = generate_word_problems(train_count, test_count, data_seed=data_seed)
    else:
        train, test = load_gsm8k(path, data_seed=data_seed, test_fraction=test_fraction)
        train, test = train[:num_train], test[:num_test]  # slicing by None keeps everything
    return Task(
        name="gsm8k",
        train=train,
        test=test,
        system_prompt=None,
        rewards=[{"name": "math", "weight": 1.0}, {"name": "format", "weight": 0.1}],
    )


# A final answer as ``normalize_answer`` leaves it: -1234, 0.5, .5, 3/4 (thousands separators and '$' removed).
_NUMERIC_ANSWER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?")


def gsm8k_example(question: str, answer_text: str) -> Example:
    """An Example from a GSM8K record; the final answer is what follows the last ``####``."""
    final = extract_final_answer(answer_text) if "####" in answer_text else None
    if final is None:
        raise ValueError("the answer has no final line '#### <number>'")
    if not _NUMERIC_ANSWER.fullmatch(final):
        raise ValueError(
            f"the final answer '#### {final[:40]}' is not a number; end the answer with '#### <number>' "
            "(an integer, decimal or fraction, e.g. '#### 42')"
        )
    return Example(question.strip(), final, answer_text.strip(), {"answer": final})


# --- loader -----------------------------------------------------------------------------------------------


def load_gsm8k(path: str | Path, *, data_seed: int = 1234, test_fraction: float = 0.1) -> tuple[list, list]:
    """(train, test) Examples from GSM8K files with ``question`` and ``answer`` fields.

    ``path`` is a ``.jsonl`` file (one JSON object per line), a ``.parquet`` file, or a directory holding
    ``train*.jsonl``/``test*.jsonl`` or ``train*.parquet``/``test*.parquet`` (searched recursively, as in the
    Hugging Face layout ``main/train-00000-of-00001.parquet``; shards of one folder are concatenated).
    A single file is shuffled with ``random.Random(data_seed)`` and split, ``test_fraction`` going to test.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        return _read_split_files(path, "train"), _read_split_files(path, "test")
    if not path.is_file():
        raise ValueError(
            f"gsm8k: path '{path}' does not exist; pass a .jsonl or .parquet file, or a directory holding "
            "train/test .jsonl or .parquet files"
        )
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"gsm8k: test_fraction must lie strictly between 0 and 1, got {test_fraction}")
    examples = _read_file(path)
    if len(examples) < 2:
        raise ValueError(
            f"gsm8k: {path} holds a single example; a single file is split into train and test, so "
            "it needs at least 2 (or pass a directory with train and test files)"
        )
    random.Random(data_seed).shuffle(examples)
    test_count = max(1, round(len(examples) * test_fraction))
    return examples[test_count:], examples[:test_count]


def _read_split_files(directory: Path, split: str) -> list[Example]:
    for suffix in (".jsonl", ".parquet"):
        files = sorted(directory.rglob(f"{split}*{suffix}"))
        if not files:
            continue
        folders = sorted({str(file.parent) for file in files})
        if len(folders) > 1:
            raise ValueError(
                f"gsm8k: found {split} files in several folders ({', '.join(folders)}); point path at one of them"
            )
        return [example for file in files for example in _read_file(file)]
    raise ValueError(f"gsm8k: no {split} file in directory '{directory}'; expected {split}.jsonl or {split}*.parquet")


def _read_file(path: Path) -> list[Example]:
    if path.suffix == ".jsonl":
        return _read_jsonl(path)
    if path.suffix == ".parquet":
        return _read_parquet(path)
    raise ValueError(f"gsm8k: cannot read '{path}'; expected a .jsonl or .parquet file")


def _read_jsonl(path: Path) -> list[Example]:
    expected = 'one JSON object {"question": ..., "answer": "... #### <number>"} per line'
    examples = []
    with path.open("rb") as lines:  # decoded line by line, so that a bad byte is reported with its line
        for line_number, raw in enumerate(lines, start=1):
            try:
                line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"gsm8k: {path}, line {line_number}: not UTF-8 text (byte {raw[err.start]:#04x} at "
                    f"column {err.start + 1}); save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                examples.append(_record_to_example(record))
            except (ValueError, TypeError) as err:  # json.JSONDecodeError is a ValueError
                raise ValueError(f"gsm8k: {path}, line {line_number}: {err}; expected {expected}") from None
    if not examples:
        raise ValueError(f"gsm8k: {path} holds no examples; expected {expected}")
    return examples


def _read_parquet(path: Path) -> list[Example]:
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise ImportError("reading GSM8K .parquet files needs pyarrow: pip install pyarrow") from None
    try:
        table = parquet.read_table(path)
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise ValueError(
            f"gsm8k: cannot read {path} as a parquet file ({str(err).strip().splitlines()[0]}); "
            "check that it is a complete .parquet file, or convert it to .jsonl"
        ) from None
    if table.num_rows == 0:
        raise ValueError(f"gsm8k: {path} holds no rows; expected 'question' and 'answer' columns with examples")
    missing = {"question", "answer"} - set(table.column_names)
    if missing:
        raise ValueError(
            f"gsm8k: {path} lacks the column(s) {', '.join(sorted(missing))}; expected 'question' and "
            f"'answer', found {', '.join(table.column_names)}"
        )
    examples = []
    for row_number, record in enumerate(table.select(["question", "answer"]).to_pylist(), start=1):
        try:
            examples.append(_record_to_example(record))
        except (ValueError, TypeError) as err:
            raise ValueError(f"gsm8k: {path}, row {row_number}: {err}") from None
    return examples


def _record_to_example(record: object) -> Example:
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    for key in ("question", "answer"):
        if key in record and record[key] is None:
            raise ValueError(f"field '{key}' is null; every example needs a question and an answer")
        if key not in record:
            found = ", ".join(f"'{name}'" for name in record) or "none"
            raise ValueError(f"missing or non-text field '{key}': the record has no '{key}' (fields found: {found})")
        if not isinstance(record[key], str):
            raise ValueError(
                f"missing or non-text field '{key}': it holds {type(record[key]).__name__} "
                f"{repr(record[key])[:40]}, not text"
            )
        if not record[key].strip():
            raise ValueError(f"field '{key}' is empty; every example needs a question and an answer")
    return gsm8k_example(record["question"], record["answer"])


# --- generator --------------------------------------------------------------------------------------------
# Each template draws its numbers from ``rng`` and returns (question, worked steps, final answer). Steps use
# GSM8K's calculator annotations "<<expression=value>>" so generated data reads like the real set.

NAMES = [
    "Ava",
    "Ben",
    "Carla",
    "Deepak",
    "Elena",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "Jamal",
    "Kofi",
    "Lena",
    "Mateo",
    "Nadia",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sven",
    "Tara",
    "Uma",
    "Victor",
    "Wen",
    "Yusuf",
]
ITEMS = ["apples", "notebooks", "pencils", "cupcakes", "stickers", "marbles", "oranges", "candles", "erasers"]
_Problem = tuple[str, list[str], int]


def _calc(left: int, operation: str, right: int) -> tuple[int, str]:
    """(value, "l op r = <<l op r=value>>value"): one annotated step; templates keep divisions exact."""
    value = {"+": left + right, "-": left - right, "*": left * right, "/": left // right}[operation]
    assert operation != "/" or left % right == 0, "templates must choose exactly divisible operands"
    return value, f"{left} {operation} {right} = <<{left}{operation}{right}={value}>>{value}"


def _shopping(rng: random.Random) -> _Problem:
    name, item, count, price = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(2, 9), rng.randint(2, 15)
    cost, step1 = _calc(count, "*", price)
    bill = rng.choice([b for b in (20, 50, 100, 200) if b > cost])
    change, step2 = _calc(bill, "-", cost)
    question = (
        f"{name} buys {count} {item} at ${price} each and pays with a ${bill} bill. "
        f"How much change, in dollars, does {name} get back?"
    )
    return question, [f"The {item} cost {step1} dollars.", f"The change is {step2} dollars."], change


def _ages(rng: random.Random) -> _Problem:
    older, younger = rng.sample(NAMES, 2)
    age, times, years = rng.randint(3, 15), rng.randint(2, 4), rng.randint(2, 12)
    now, step1 = _calc(age, "*", times)
    later, step2 = _calc(now, "+", years)
    question = (
        f"{older} is {times} times as old as {younger}. {younger} is {age} years old. "
        f"How old will {older} be in {years} years?"
    )
    return question, [f"{older} is {step1} years old now.", f"In {years} years {older} will be {step2}."], later


def _distance(rng: random.Random) -> _Problem:
    speed1, hours1 = rng.randrange(20, 75, 5), rng.randint(2, 5)
    speed2, hours2 = rng.randrange(20, 75, 5), rng.randint(2, 5)
    first, step1 = _calc(speed1, "*", hours1)
    second, step2 = _calc(speed2, "*", hours2)
    total, step3 = _calc(first, "+", second)
    question = (
        f"A train travels at {speed1} miles per hour for {hours1} hours, then at {speed2} miles per "
        f"hour for {hours2} hours. How many miles does it travel in total?"
    )
    steps = [f"First it covers {step1} miles.", f"Then it covers {step2} miles.", f"In total {step3} miles."]
    return question, steps, total


def _sharing(rng: random.Random) -> _Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each = rng.randint(2, 8), rng.randint(3, 15)
    given_away = rng.randint(1, each - 1)
    share, step1 = _calc(friends * each, "/", friends)
    left, step2 = _calc(share, "-", given_away)
    question = (
        f"{name} has {friends * each} {item} and shares them equally among {friends} friends. "
        f"Each friend then gives away {given_away} of them. How many {item} does each friend have left?"
    )
    return question, [f"Each friend gets {step1} {item}.", f"Each friend has {step2} left."], left


def _discount(rng: random.Random) -> _Problem:
    item = rng.choice(["jacket", "bicycle", "lamp", "backpack", "guitar", "tent"])
    price, percent = 20 * rng.randint(1, 20), rng.choice([5, 10, 15, 20, 25, 30, 40, 50, 75])
    discount = price * percent // 100  # exact: price is a multiple of 20 and percent of 5
    step1 = f"{price} * {percent} / 100 = <<{price}*{percent}/100={discount}>>{discount}"
    sale, step2 = _calc(price, "-", discount)
    question = f"A {item} costs ${price}. It is on sale for {percent}% off. What is the sale price in dollars?"
    return question, [f"The discount is {step1} dollars.", f"The sale price is {step2} dollars."], sale


def _savings(rng: random.Random) -> _Problem:
    name, weekly, weeks = rng.choice(NAMES), rng.randint(5, 50), rng.randint(2, 12)
    saved, step1 = _calc(weekly, "*", weeks)
    spent = rng.randint(1, saved - 1)
    left, step2 = _calc(saved, "-", spent)
    thing = rng.choice(["a video game", "a pair of shoes", "a concert ticket", "a board game"])
    question = (
        f"{name} saves ${weekly} every week. After {weeks} weeks, {name} spends ${spent} on {thing}. "
        f"How many dollars does {name} have left?"
    )
    return question, [f"{name} saves {step1} dollars.", f"{name} has {step2} dollars left."], left


def _boxes(rng: random.Random) -> _Problem:
    trays, box_size = rng.randint(2, 6), rng.randint(2, 12)
    per_tray = box_size * rng.randint(1, 4) // math.gcd(trays, box_size)  # makes trays · per_tray divisible
    muffins, step1 = _calc(trays, "*", per_tray)
    boxes, step2 = _calc(muffins, "/", box_size)
    question = (
        f"A baker bakes {trays} trays of {per_tray} muffins and packs them in boxes of {box_size}. "
        "How many boxes does the baker fill?"
    )
    return question, [f"The baker bakes {step1} muffins.", f"That fills {step2} boxes."], boxes


def _fence(rng: random.Random) -> _Problem:
    length, width, cost = rng.randint(5, 40), rng.randint(3, 30), rng.randint(2, 12)
    half, step1 = _calc(length, "+", width)
    perimeter, step2 = _calc(half, "*", 2)
    total, step3 = _calc(perimeter, "*", cost)
    question = (
        f"A rectangular garden is {length} meters long and {width} meters wide. Fencing costs ${cost} "
        "per meter. How many dollars does it cost to fence the whole garden?"
    )
    steps = [
        f"Length plus width is {step1} meters.",
        f"The perimeter is {step2} meters.",
        f"The fence costs {step3} dollars.",
    ]
    return question, steps, total


def _reading(rng: random.Random) -> _Problem:
    name, per_day, days = rng.choice(NAMES), rng.randint(5, 40), rng.randint(2, 14)
    pages = per_day * days + rng.randint(10, 200)
    read, step1 = _calc(per_day, "*", days)
    left, step2 = _calc(pages, "-", read)
    question = (
        f"{name}'s book has {pages} pages. {name} reads {per_day} pages every day for {days} days. "
        "How many pages are left to read?"
    )
    return question, [f"{name} reads {step1} pages.", f"There are {step2} pages left."], left


def _collection(rng: random.Random) -> _Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    red, blue = rng.randint(3, 500), rng.randint(3, 500)
    total, step = _calc(red, "+", blue)
    question = f"{name} has {red} red {item} and {blue} blue {item}. How many {item} does {name} have?"
    return question, [f"{name} has {step} {item}."], total


WORD_PROBLEM_TEMPLATES: list[Callable[[random.Random], _Problem]] = [
    _shopping,
    _ages,
    _distance,
    _sharing,
    _discount,
    _savings,
    _boxes,
    _fence,
    _reading,
    _collection,
]


def generate_word_problems(num_train: int, num_test: int, *, data_seed: int = 1234) -> tuple[list, list]:
    """(train, test) templated GSM8K-style problems; distinct questions, none shared between the splits."""
    rng = random.Random(data_seed)
    seen: set[str] = set()
    test = _draw_problems(rng, num_test, seen)  # test first, so it does not change with num_train
    return _draw_problems(rng, num_train, seen), test


def _draw_problems(rng: random.Random, count: int, seen: set[str]) -> list[Example]:
    examples: list[Example] = []
    max_attempts = 20 * count + 1000
    for _ in range(max_attempts):
        if len(examples) == count:
            return examples
        question, steps, answer = rng.choice(WORD_PROBLEM_TEMPLATES)(rng)
        if question not in seen:
            seen.add(question)
            examples.append(gsm8k_example(question, "\n".join(steps + [f"#### {answer}"])))
    if len(examples) == count:
        return examples
    raise ValueError(f"gsm8k: could not generate {count} distinct word problems; request fewer")
