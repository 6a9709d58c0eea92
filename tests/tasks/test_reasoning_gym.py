"""The `reasoning_gym` task: any reasoning-gym generator, generated on the spot, scored by its own score_answer."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tests.helpers.configs import DETERMINISTIC_PPO
from unipg.cli import app
from unipg.observe.metrics import read_metrics
from unipg.tasks.base import make_task
from unipg.tasks.rewards.rules import build_rewards

pytest.importorskip("reasoning_gym")

ONE_DIGIT_SUMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def test_a_generator_gives_reproducible_splits_that_share_no_question():
    task = make_task("reasoning_gym", dataset="chain_sum", size=40, num_test=8, seed=3, config=ONE_DIGIT_SUMS)
    again = make_task("reasoning_gym", dataset="chain_sum", size=40, num_test=8, seed=3, config=ONE_DIGIT_SUMS)
    assert len(task.train) + len(task.validation) == 40 and 0 < len(task.test) <= 8
    assert [e.prompt for e in task.train] == [e.prompt for e in again.train]
    assert not {e.prompt for e in task.train} & {e.prompt for e in task.test}
    assert all(e.prompt.count("+") + e.prompt.count("-") == 1 for e in task.train)  # the config reached it
    legs = make_task("reasoning_gym", dataset="leg_counting", size=5, num_test=2)
    assert "legs" in legs.train[0].prompt and legs.train[0].answer.isdigit()


def test_the_generators_own_score_grades_the_completion():
    task = make_task("reasoning_gym", dataset="basic_arithmetic", size=4, num_test=1)
    example = task.train[0]
    reward = build_rewards(task.rewards)
    completions = [example.answer, f"thinking... <answer>{example.answer}</answer>", "<answer>nonsense</answer>"]
    scored = reward([example.prompt] * 3, completions, **{name: [value] * 3 for name, value in example.columns.items()})
    assert scored.per_function["reasoning_gym"] == [1.0, 1.0, 0.0]


def test_an_unknown_generator_or_setting_says_what_to_fix():
    with pytest.raises(ValueError, match="unknown generator 'chain_sums'; did you mean chain_sum"):
        make_task("reasoning_gym", dataset="chain_sums")
    with pytest.raises(ValueError, match="generator 'chain_sum' refused config {'bogus': 1}"):
        make_task("reasoning_gym", dataset="chain_sum", config={"bogus": 1})
    with pytest.raises(ValueError, match="size must be a positive integer"):
        make_task("reasoning_gym", dataset="chain_sum", size=0)


@pytest.mark.e2e
def test_unipg_train_on_a_reasoning_gym_generator(embedded_path, tmp_path):
    quick = [item for item in DETERMINISTIC_PPO if not item.startswith("task.")]
    result = CliRunner().invoke(
        app,
        [
            "train",
            "task.name=reasoning_gym",
            "task.options={dataset: chain_sum, size: 40, num_test: 4, config: "
            "{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}}",
            *quick,
            f"model.name={embedded_path}",
            f"log.output_dir={tmp_path / 'runs'}",
        ],
    )
    assert result.exit_code == 0, result.output
    run_dir = next((tmp_path / "runs").iterdir())
    steps = [record for record in read_metrics(run_dir) if "train/loss" in record]
    assert [record["step"] for record in steps] == [1, 2, 3] and "rollout/reward_reasoning_gym" in steps[0]


def test_a_text_answer_between_answer_tags_is_scored_and_counted_correct():
    """Evaluation's completion rate reads the answer between <answer> tags, so text answers count too."""
    import asyncio

    from unipg.envs.base import final_answer_reward

    task = make_task("reasoning_gym", dataset="spell_backward", size=2, num_test=1)
    example = task.train[0]
    assert not example.answer.isdigit()
    reward_fn = build_rewards(task.rewards)
    right = asyncio.run(final_answer_reward(reward_fn, example, f"<answer>{example.answer}</answer>"))
    wrong = asyncio.run(final_answer_reward(reward_fn, example, "<answer>zzz</answer>"))
    assert (right[0], right[1].correct) == (1.0, True) and (wrong[0], wrong[1].correct) == (0.0, False)
