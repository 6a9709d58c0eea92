"""A user's plugin file (a task, its tool and its reward) written where a test needs one, and the overrides of a
short run on its task."""

import textwrap
from pathlib import Path

# A user's task in the style of the built-in calculator task: its own tool, task and reward, in one file.
LETTERS_PLUGIN = textwrap.dedent('''
    import random

    from unipg.tasks.rewards.rules import REWARDS, text_of
    from unipg.tasks.base import TASKS, Example, Task
    from unipg.tools.base import TOOLS, format_tool_call, tool


    def letters(word: str) -> str:
        """Count the letters of a word.

        Args:
            word: the word whose letters are counted.
        """
        return str(len(word))


    @TOOLS.register("letters_{tag}")
    def letters_tool():
        return tool(letters)


    @REWARDS.register("same_count_{tag}")
    def same_count():
        def same_count_reward(prompts, completions, count, **columns):
            return [float(text_of(c, "assistant").strip() == str(n)) for c, n in zip(completions, count)]
        return same_count_reward


    @TASKS.register("letter_count_{tag}")
    def letter_count_task(num_train: int = 24, num_test: int = 4, data_seed: int = 0) -> Task:
        rng = random.Random(data_seed)
        words = ["".join(rng.choice("abcdef") for _ in range(rng.randint(2, 6))) for _ in range(num_train + num_test)]

        def example(word):
            call = format_tool_call("letters_{tag}", {{"word": word}})
            solution = [{{"role": "assistant", "content": call}}, {{"role": "tool", "content": str(len(word))}},
                        {{"role": "assistant", "content": str(len(word))}}]
            return Example(f"How many letters has {{word}}?", str(len(word)), solution,
                           {{"answer": str(len(word)), "count": len(word)}})

        return Task(name="letter_count_{tag}", train=[example(w) for w in words[:num_train]],
                    test=[example(w) for w in words[num_train:]], system_prompt=None,
                    rewards=[{{"name": "same_count_{tag}"}}], tools=[{{"name": "letters_{tag}"}}], max_turns=2)
''')

# two GRPO updates of eight short completions; no checkpoints or rollback
FAST = [
    "sample.max_new_tokens=6",
    "agent.max_total_tokens=24",
    "algorithm=grpo",
    "train.batch_size=8",
    "train.mini_batch_size=8",
    "train.micro_batch_size=8",
    "sample.samples_per_prompt=4",
    "eval.every_updates=100",
    "eval.pass_k=0",
    "eval.max_examples=4",
    "log.progress=false",
    "log.tensorboard=false",
    "checkpoint.every_updates=0",
    "rollback.enabled=false",
    "train.updates=2",
]


def write_plugin(folder: Path, tag: str, name: str = "my_task.py") -> Path:
    """``LETTERS_PLUGIN`` as ``folder/name``, its task, tool and reward names ending in ``_{tag}``."""
    path = folder / name
    path.write_text(LETTERS_PLUGIN.format(tag=tag), encoding="utf-8")
    return path
