"""``reasoning_gym``: procedurally generated problems from any generator of the ``reasoning-gym`` package (Stojanovski
et al. 2025), generated on the spot, with no download::

    task:
      name: reasoning_gym
      options: {dataset: chain_sum, size: 2000, seed: 1, config: {min_terms: 2, max_terms: 3}}

``dataset`` names the generator (``basic_arithmetic``, ``chain_sum``, ``leg_counting``, ... — any name of
``reasoning_gym.factory.DATASETS``); ``config`` is handed to it as its own settings (its ``*Config`` fields).
The train split is ``size`` problems drawn with ``seed``; the test split is the ``num_test`` problems that
follow them (a generator draws problem i with ``seed + i``, so the test split is drawn with ``seed + size``),
minus any whose question is also in train. Each example keeps the generator's whole entry
(question, answer, metadata) in the column ``entry``, which the default reward ``reasoning_gym``
(``unipg.tasks.rewards.procedural``) hands to the generator's own ``score_answer``.
"""

from __future__ import annotations

from unipg.tasks.base import TASKS, Example, Task


@TASKS.register("reasoning_gym")
def reasoning_gym_task(
    dataset: str, size: int = 1000, num_test: int = 100, seed: int = 1234, config: dict | None = None
) -> Task:
    """Problems of the reasoning-gym generator ``dataset`` (module docstring)."""
    for option, value in (("size", size), ("num_test", num_test)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"reasoning_gym: {option} must be a positive integer, got {value!r}")
    if config is not None and not isinstance(config, dict):
        raise ValueError(
            f"reasoning_gym: config must be a mapping of the generator's settings, e.g. "
            f"{{min_terms: 2}}; got {config!r}"
        )
    train = _generate(dataset, size, seed, config or {})
    seen = {entry["question"] for entry in train}
    test = [entry for entry in _generate(dataset, num_test, seed + size, config or {}) if entry["question"] not in seen]
    return Task(
        name="reasoning_gym",
        train=[_example(entry) for entry in train],
        test=[_example(entry) for entry in test],
        system_prompt=None,
        rewards=[{"name": "reasoning_gym", "weight": 1.0}],
    )


def _generate(dataset: str, size: int, seed: int, config: dict) -> list[dict]:
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ValueError(
            "task 'reasoning_gym' needs the reasoning-gym package: pip install 'unipg[procedural]'"
        ) from None
    if dataset not in DATASETS:
        import difflib

        close = difflib.get_close_matches(dataset, list(DATASETS), n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ValueError(
            f"reasoning_gym: unknown generator '{dataset}'; {hint}{len(DATASETS)} are available, "
            f"e.g. basic_arithmetic, chain_sum, leg_counting (reasoning_gym.factory.DATASETS)"
        )
    try:
        generator = reasoning_gym.create_dataset(dataset, size=size, seed=seed, **config)
    except (TypeError, ValueError, AssertionError) as error:
        raise ValueError(f"reasoning_gym: generator '{dataset}' refused config {config}: {error}") from None
    return [generator[index] for index in range(len(generator))]


def _example(entry: dict) -> Example:
    answer = str(entry["answer"])
    return Example(entry["question"], answer, answer, {"answer": answer, "entry": entry})
