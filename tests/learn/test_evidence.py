"""The warm start's evidence stop: greedy call validity and argument copying on held-out demonstrations."""

import pytest

from unipg.config import load_config
from unipg.envs.service import EnvironmentService
from unipg.learn import evidence as evidence_module
from unipg.learn.evidence import answer_evidence, answer_turns, call_evidence, call_scores
from unipg.learn.sft_eval import greedy_completions
from unipg.learn.warm_start import fine_tune_on_demonstrations, warm_start_key
from unipg.policy.loading import load_lm_policy
from unipg.tasks.base import make_task
from unipg.tools.base import format_tool_call

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TASKS = {
    "calculator": {"digits": 1, "num_train": 16, "num_test": 4, "tool_demonstrations": 1.0},
    "units": {"digits": 1, "num_train": 16, "num_test": 4, "tool_demonstrations": 1.0},
}


def config_for(name, *overrides):
    import json

    return load_config(
        None,
        [
            f"task.name={name}",
            f"task.options={json.dumps(TASKS[name])}",
            "sft.batch_size=4",
            "sample.max_new_tokens=8",
            *overrides,
        ],
    )


def test_call_scores_count_valid_calls_and_exactly_copied_arguments():
    service = EnvironmentService.from_specs([{"name": "convert"}])
    demonstrated = format_tool_call("convert", {"value": 3, "from_unit": "km", "to_unit": "m"})
    turns = [
        demonstrated,
        format_tool_call("convert", {"value": 4, "from_unit": "km", "to_unit": "m"}),
        format_tool_call("convert", {"value": 3, "from_unit": "parsec", "to_unit": "m"}),
        "3000",
    ]
    try:
        assert call_scores(turns, [demonstrated] * 4, service) == {
            "call_validity": 0.5,
            "argument_accuracy": 0.25,
            "argument/value": 0.25,
            "argument/from_unit": 0.5,
            "argument/to_unit": 0.5,
        }
    finally:
        service.close()


@pytest.mark.parametrize("name", sorted(TASKS))
def test_a_stage_stops_once_the_evidence_passes_and_otherwise_runs_to_its_cap(embedded_path, name):
    task = make_task(name, **TASKS[name])
    lines = []
    # (call and argument thresholds, answer threshold): the answer's threshold holds a stage alone, too
    for calls, answers, expected_steps, checks in (("0.0", "0.0", 4, 1), ("1.0", "1.0", 12, 2), ("0.0", "1.0", 12, 2)):
        config = config_for(
            name,
            "sft.steps=12",
            "sft.evidence_stop=all",
            "sft.evidence_every=4",
            f"sft.min_call_validity={calls}",
            f"sft.min_argument_accuracy={calls}",
            f"sft.min_answer_accuracy={answers}",
        )
        policy = load_lm_policy(embedded_path)
        metrics = fine_tune_on_demonstrations(
            policy.model, policy.tokenizer, task, config, seed=0, log_every=100, log=lines.append
        )
        assert metrics["steps"] == expected_steps and len(metrics["evidence"]) == checks
        assert {"stage", "step", "call_validity", "argument_accuracy", "answer_accuracy"} < set(metrics["evidence"][0])
    assert any(
        "evidence: call validity" in line and "answer accuracy" in line and "stage ends" in line for line in lines
    )


def test_stages_mode_leaves_the_main_stage_to_run_its_steps(embedded_path):
    config = config_for(
        "calculator",
        "sft.steps=6",
        "sft.evidence_stop=stages",
        "sft.evidence_every=2",
        "sft.min_call_validity=0",
        "sft.min_argument_accuracy=0",
        "sft.min_answer_accuracy=0",
        "sft.stages=[{steps: 6, options: {tool_demonstrations: 1.0}}]",
    )
    policy = load_lm_policy(embedded_path)
    metrics = fine_tune_on_demonstrations(
        policy.model,
        policy.tokenizer,
        make_task("calculator", **TASKS["calculator"]),
        config,
        seed=0,
        log_every=100,
        log=lambda text: None,
    )
    assert metrics["steps"] == 6 and [entry["step"] for entry in metrics["evidence"]] == [2]


def test_off_by_default_and_then_the_warm_start_cache_key_is_unchanged(embedded_path):
    config = config_for("calculator")
    assert config.sft.evidence_stop == "off"
    assert not {"evidence_stop", "min_call_validity"} & set(warm_start_key(config)["sft"])
    assert warm_start_key(config) != warm_start_key(config_for("calculator", "sft.evidence_stop=all"))
    policy = load_lm_policy(embedded_path)
    evidence = call_evidence(
        policy.model,
        policy.tokenizer,
        make_task("calculator", **TASKS["calculator"]),
        config,
        make_task("calculator", **TASKS["calculator"]).test,
    )
    assert set(evidence) == {"call_validity", "argument_accuracy", "argument/expression"}


@pytest.mark.parametrize("name", sorted(TASKS))
def test_the_answer_is_asked_for_after_the_demonstrated_call_and_the_tools_result(embedded_path, name, monkeypatch):
    task, config = make_task(name, **TASKS[name]), config_for(name)
    policy = load_lm_policy(embedded_path)
    prompts = []

    def recording(model, tokenizer, texts, **kwargs):
        prompts.extend(texts)
        return greedy_completions(model, tokenizer, texts, **kwargs)

    monkeypatch.setattr(evidence_module, "greedy_completions", recording)
    pairs = answer_turns(policy.model, policy.tokenizer, task, config, task.test)
    assert [answer for _, answer in pairs] == [example.answer for example in task.test]
    for prompt, example in zip(prompts, task.test):
        call, result = example.solution[0]["content"], example.solution[1]["content"]
        assert prompt.index(example.prompt) < prompt.index(call) < prompt.rindex(result)
        assert prompt.endswith(f"<|tool|>{result}<|end|><|assistant|>")  # the embedded chat template
    evidence = answer_evidence(policy.model, policy.tokenizer, task, config, task.test)
    assert 0.0 <= evidence["answer_accuracy"] <= 1.0


def test_demonstrations_without_a_call_are_judged_on_the_turn_after_the_message_they_answer(embedded_path):
    from unipg.learn.evidence import evidence_check
    from unipg.tasks.base import role_task

    options = {"digits": 2, "num_train": 12, "num_test": 2, "solver_tool": False, "tool_demonstrations": 0.0}
    team = make_task("solver_checker", critique_demonstrations=1.0, **options)
    team.validation = team.train[:3]
    solver = role_task(team, "solver", "solve")  # per problem: a guess, and a critique answered by a copy
    config = load_config(None, ["task.name=solver_checker", "sft.evidence_examples=8", "sample.max_new_tokens=8"])
    policy, logged = load_lm_policy(embedded_path), []
    check = evidence_check(policy.model, policy.tokenizer, solver, config, stage="stage 1 ", log=logged.append)
    assert check(100) is False  # an untrained model does not copy
    assert set(check.history[0]) == {"stage", "step", "answer_accuracy"}  # no call to judge
    assert logged[0].startswith("stage 1 step 100 evidence: no call, answer accuracy 0.00")
    pairs = answer_turns(policy.model, policy.tokenizer, solver, config, solver.validation)
    assert [answer for _, answer in pairs] == [example.answer for example in team.validation]  # the copies


def test_every_trained_turn_after_the_first_is_judged_so_a_checker_is_asked_about_a_wrong_proposal(
    embedded_path, monkeypatch
):
    from unipg.tasks.base import role_task

    options = {"digits": 2, "num_train": 12, "num_test": 2, "solver_tool": False, "tool_demonstrations": 0.0}
    team = make_task("solver_checker", agreement=True, **options)
    checker = role_task(team, "checker", "check")  # per problem: a right proposal, a wrong one asked about twice
    config = load_config(None, ["task.name=solver_checker", "sample.max_new_tokens=8"])
    policy, prompts = load_lm_policy(embedded_path), []

    def recording(model, tokenizer, texts, **kwargs):
        prompts.extend(texts)
        return greedy_completions(model, tokenizer, texts, **kwargs)

    monkeypatch.setattr(evidence_module, "greedy_completions", recording)
    example = team.train[0]
    pairs = answer_turns(policy.model, policy.tokenizer, checker, config, checker.train[:2])
    assert [answer for _, answer in pairs] == [example.answer] * 3  # the reply to each of the two, then round 2
    wrong_first = prompts[1]  # after the call and the tool's result, with the wrong proposal in the context
    assert "Proposed: " in wrong_first and f"Proposed: {example.answer}" not in wrong_first
    assert wrong_first.endswith(f"<|tool|>{example.answer}<|end|><|assistant|>")
    again = checker.train[1].solution[-2]["content"]  # the solver's copy, or its wrong proposal repeated
    assert prompts[2].startswith(wrong_first) and prompts[2].endswith(f"{again}<|end|><|assistant|>")
