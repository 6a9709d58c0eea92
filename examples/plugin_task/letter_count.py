"""A task of your own, with its own tool and reward, registered from a plugin file (no wrapper script).

``config.yaml`` next to this file lists it under ``plugins:``; ``unipg train --config
examples/plugin_task/config.yaml`` imports it before the config is checked, so ``task.name: letter_count``,
the ``letters`` tool and the ``same_count`` reward can be named there.
"""

from __future__ import annotations

import random

from unipg.tasks import REWARDS, TASKS, Example, RewardFunction, Task, text_of
from unipg.tools import TOOLS, Tool, format_tool_call, tool


def letters(word: str) -> str:
    """Count the letters of a word.

    Args:
        word: the word whose letters are counted.
    """
    return str(len(word))


@TOOLS.register("letters")
def letters_tool() -> Tool:
    return tool(letters)


@REWARDS.register("same_count")
def same_count() -> RewardFunction:
    """1.0 when the final turn is exactly the number of letters (the task's ``count`` column), else 0.0."""

    def same_count_reward(prompts: list, completions: list, count: list) -> list[float]:
        return [float(text_of(c, "assistant").strip() == str(n)) for c, n in zip(completions, count)]

    return same_count_reward


@TASKS.register("letter_count")
def letter_count_task(num_train: int = 500, num_test: int = 50, data_seed: int = 0) -> Task:
    """ "How many letters has <word>?" for made-up words of 2 to 12 letters; solved with one ``letters`` call."""
    rng = random.Random(data_seed)
    words = sorted(
        {
            "".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 12)))
            for _ in range(3 * (num_train + num_test))
        }
    )
    rng.shuffle(words)

    def example(word: str) -> Example:
        count = str(len(word))
        solution = [
            {"role": "assistant", "content": format_tool_call("letters", {"word": word})},
            {"role": "tool", "content": count},
            {"role": "assistant", "content": count},
        ]
        return Example(f"How many letters has {word}?", count, solution, {"answer": count, "count": len(word)})

    return Task(
        name="letter_count",
        train=[example(w) for w in words[:num_train]],
        test=[example(w) for w in words[num_train : num_train + num_test]],
        system_prompt=None,
        rewards=[{"name": "same_count"}],
        tools=[{"name": "letters"}],
        max_turns=2,
    )
