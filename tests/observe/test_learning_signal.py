"""The doctor says when nearly every prompt group scores all its episodes alike, and what to change."""

from unipg.observe.doctor import Monitor, diagnose
from unipg.observe.learning_signal import mixed_group_chance
from unipg.observe.rollout_metrics import group_signal_metrics

CONFIG = {"sample": {"samples_per_prompt": 8, "temperature": 1.0}}


def records(uniform: float, unsolved: float, solved: float, *, completion: float, steps: int = 30) -> list[dict]:
    return [
        {
            "step": i,
            "rollout/reward_mean": completion,
            "rollout/completion_rate": completion,
            "rollout/uniform_group_fraction": uniform,
            "rollout/unsolved_group_fraction": unsolved,
            "rollout/solved_group_fraction": solved,
        }
        for i in range(steps)
    ]


def finding(found, check="zero_variance_groups"):
    return next(f for f in found if f.check == check)


def test_groups_that_all_fail_are_diagnosed_with_what_to_change():
    found = finding(diagnose(records(0.97, 0.96, 0.01, completion=0.02), config=CONFIG))
    assert found.severity == "warning" and found.metric == "rollout/uniform_group_fraction"
    assert "averaged 97%" in found.evidence and "96% of groups: every episode failed" in found.evidence
    for setting in (
        "sft.steps",
        "sample.samples_per_prompt (now 8)",
        "sample.temperature (now 1.0)",
        "agent.process_weight",
        "task.options",
    ):
        assert setting in found.remedy
    assert "a group of 64 has a success and a failure 73% of the time, against 15% now" in found.remedy


def test_groups_without_a_success_are_flagged_even_when_process_rewards_make_them_differ():
    # seen on the units task: 94% of groups had no success, but calls earned process rewards in 55% of them
    found = finding(diagnose(records(0.45, 0.94, 0.0, completion=0.01), config=CONFIG))
    assert "unsolved_group_fraction averaged 94%" in found.evidence and "only process rewards" in found.evidence
    assert "sample.samples_per_prompt (now 8)" in found.remedy


def test_groups_that_all_succeed_are_a_solved_task_not_a_learning_problem():
    found = finding(diagnose(records(0.95, 0.0, 0.95, completion=0.98), config=CONFIG))
    assert "every episode succeeded" in found.evidence and "harder" in found.remedy


def test_groups_with_mixed_outcomes_or_too_few_updates_are_not_flagged():
    assert not [f for f in diagnose(records(0.6, 0.4, 0.2, completion=0.3)) if f.check == "zero_variance_groups"]
    assert not [
        f for f in diagnose(records(1.0, 1.0, 0.0, completion=0.0, steps=2)) if f.check == "zero_variance_groups"
    ]


def test_the_live_monitor_reports_it_once():
    monitor, reported = Monitor(config=CONFIG, min_records=5), []
    for record in records(0.97, 0.96, 0.01, completion=0.02, steps=12):
        metrics = {key: value for key, value in record.items() if key != "step"}
        reported += [f.check for f in monitor.observe(record["step"], metrics)]
    assert reported.count("zero_variance_groups") == 1


def test_group_signal_metrics_count_uniform_unsolved_and_solved_groups():
    scores = [0.0, 0.0, 1.1, 1.1, 0.1, 0.0, 1.0, 0.0]  # four groups of two
    correct = [False, False, True, True, False, False, True, False]
    assert group_signal_metrics(scores, correct, 2) == {
        "rollout/uniform_group_fraction": 0.5,
        "rollout/unsolved_group_fraction": 0.5,
        "rollout/solved_group_fraction": 0.25,
    }
    assert group_signal_metrics(scores, correct, 1)["rollout/uniform_group_fraction"] == 0.0


def test_mixed_group_chance_is_one_minus_both_uniform_outcomes():
    assert mixed_group_chance(0.5, 2) == 0.5 and mixed_group_chance(0.0, 8) == 0.0
