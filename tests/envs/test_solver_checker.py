"""The solver–checker team's task and environment: what the checker is shown, and the config the team trains
with beside the solver alone."""

import asyncio
from pathlib import Path

import pytest

from unipg.config import load_config
from unipg.envs import EnvironmentService
from unipg.envs.service import build_tools
from unipg.envs.solver_checker import SolverCheckerEnv
from unipg.tasks.base import Example, make_task
from unipg.tasks.rewards.rules import build_rewards
from unipg.tasks.solver_checker import CHECKER, checker_observation

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PROBLEM = Example("What is 12*34?", "408", "", {"answer": "408"})


def checker_sees(proposal: str) -> str:
    service = EnvironmentService(build_tools([{"name": "calculator"}]), timeout=5.0)
    env = SolverCheckerEnv(build_rewards([{"name": "math"}]), service)

    async def episode():
        await env.reset(PROBLEM)
        return await env.step(proposal)

    try:
        return asyncio.run(episode()).observation
    finally:
        service.close()


def test_the_checker_sees_the_proposed_number_whether_the_solver_guessed_in_a_sentence_or_copied_the_tool():
    # the solver's guesses are sentences ("The answer is 418."), its tool answers bare numbers; the checker's
    # demonstrations show "Proposed: <number>", so a sentence would be an input it never saw
    assert checker_sees("The answer is 418.") == "What is 12*34? Proposed: 418"
    assert checker_sees("408") == "What is 12*34? Proposed: 408"
    assert checker_sees("no idea") == "What is 12*34? Proposed: no idea"


def test_the_checker_demonstrations_show_what_the_checker_is_shown_in_episodes():
    task = make_task("solver_checker", digits=3, num_train=20, num_test=4)
    for example in task.train[:5]:
        checks = [first for role, first, _ in task.role_demonstrations(example) if role == CHECKER]
        assert checks[0] == f"{example.prompt} Proposed: {example.answer}"
        assert checks[0] == checker_observation(example, f"The answer is {example.answer}.")


def test_the_team_trains_with_the_solver_alones_model_warm_start_and_sampling():
    # the team-vs-solo comparison (benchmarks/team_vs_solo.py) holds everything but the second role equal: the
    # model that reads numbers in digit groups, the warm-start stages, learning rate, temperature, sample budget
    team = load_config(CONFIGS / "solver_checker.yaml")
    solo = load_config(CONFIGS / "calculator_agent.yaml")
    assert team.model.name == solo.model.name
    assert team.sft.stages == solo.sft.stages
    assert team.train.learning_rate == solo.train.learning_rate
    assert team.sample.temperature == solo.sample.temperature
    assert (team.train.batch_size, team.train.updates) == (solo.train.batch_size, solo.train.updates)
    assert team.sample.samples_per_prompt == solo.sample.samples_per_prompt


def run_turns(env: SolverCheckerEnv, turns: list[str]) -> list:
    async def episode():
        await env.reset(PROBLEM)
        return [await env.step(turn) for turn in turns]

    return asyncio.run(episode())


def test_without_the_solver_tool_no_solver_demonstration_calls_the_calculator_and_every_checker_one_does():
    task = make_task("solver_checker", digits=3, num_train=20, num_test=4, solver_tool=False, tool_demonstrations=0.0)
    assert task.env_options["solver_tool"] is False
    for example in task.train:
        for role, _, solution in task.role_demonstrations(example):
            turns = [solution] if isinstance(solution, str) else [m["content"] for m in solution]
            calls = any("<tool_call>" in turn for turn in turns)
            assert calls == (role == CHECKER), (role, solution)


def test_a_solver_without_the_tool_cannot_call_it_and_the_checkers_call_still_runs():
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
    service = EnvironmentService(build_tools([{"name": "calculator"}]), timeout=5.0)
    try:
        env = SolverCheckerEnv(build_rewards([{"name": "math"}]), service, solver_tool=False)
        proposal, checked, critique, answer = run_turns(env, [call, call, "REJECT: 408", "408"])
        assert proposal.info.next_role == CHECKER  # the solver's call was its proposal, not run
        assert proposal.info.extras["proposal_correct"] is False
        assert checked.info.next_role == CHECKER and checked.observation.strip() == "408"  # the checker's ran
        assert critique.observation == "REJECT: 408" and not critique.done
        assert answer.info.next_role == CHECKER and answer.info.extras["proposal_correct"] is True
        with_tool = SolverCheckerEnv(build_rewards([{"name": "math"}]), service)
        (solver_call,) = run_turns(with_tool, [call])
        assert solver_call.observation.strip() == "408" and solver_call.info.next_role == "solver"
    finally:
        service.close()


def test_solver_tool_false_needs_no_solver_tool_demonstrations():
    with pytest.raises(ValueError, match="tool_demonstrations to 0"):
        make_task("solver_checker", digits=3, num_train=4, num_test=2, solver_tool=False, tool_demonstrations=0.1)


def test_the_checker_tool_team_trains_with_the_tool_less_solvers_model_warm_start_and_sampling():
    team = load_config(CONFIGS / "solver_checker_tool_checker.yaml")
    solo = load_config(CONFIGS / "solver_no_tool.yaml")
    assert team.task.options["solver_tool"] is False and solo.task.tools == []
    assert team.model.name == solo.model.name
    schedule = [(stage.steps, stage.learning_rate, stage.batch_size) for stage in team.sft.stages]
    assert schedule == [(stage.steps, stage.learning_rate, stage.batch_size) for stage in solo.sft.stages]
    assert team.sft.steps == solo.sft.steps
    assert team.train.learning_rate == solo.train.learning_rate
    assert team.sample.temperature == solo.sample.temperature
    assert (team.train.batch_size, team.train.updates) == (solo.train.batch_size, solo.train.updates)
    assert team.sample.samples_per_prompt == solo.sample.samples_per_prompt


def test_one_roles_side_of_the_team_task_is_a_one_role_task_of_that_roles_demonstrations():
    from unipg.tasks.base import role_task

    team = make_task("solver_checker", digits=3, num_train=6, num_test=2, solver_tool=False, tool_demonstrations=0.0)
    team.validation = team.train[:2]
    checker = role_task(team, CHECKER, "check")
    assert len(checker.train) == 2 * len(team.train) and len(checker.validation) == 4  # accept and reject, each
    assert all(
        example.prompt.startswith(original.prompt + " Proposed: ")
        for example, original in zip(checker.train[::2], team.train)
    )
    assert all("<tool_call>" in example.solution[0]["content"] for example in checker.train)
    assert checker.system_prompt == "check" and checker.roles == {} and checker.test == []
    solver = role_task(team, "solver", "solve")
    assert {example.prompt for example in solver.train} == {example.prompt for example in team.train}
    assert not any("<tool_call>" in str(example.solution) for example in solver.train)
    with pytest.raises(ValueError, match="has no role 'judge'"):
        role_task(team, "judge", None)


def test_with_a_model_per_role_each_roles_model_is_warm_started_on_its_own_demonstrations(tmp_path, monkeypatch):
    import json

    import unipg.learn.warm_start as warm_start

    shown, real_sft_train = {}, warm_start.sft_train

    def sft_train(model, tokenizer, pairs, **kwargs):
        shown[model] = [prompt for prompt, _ in pairs]
        return real_sft_train(model, tokenizer, pairs, **kwargs)

    monkeypatch.setattr(warm_start, "sft_train", sft_train)
    overrides = [
        "task.options.num_train=8",
        "task.options.num_test=2",
        "sft.stages=[]",
        "sft.evidence_stop=off",
        "sft.steps=1",
        "sft.batch_size=2",
        "agent.roles.solver.sft_stages=[{steps: 1, options: {critique_copies: 1.0}}]",
    ]
    config = load_config(CONFIGS / "solver_checker_tool_checker.yaml", overrides)
    task = make_task("solver_checker", **config.task.options)
    resolved = warm_start.resolve_warm_start(config, task, root=tmp_path, log=lambda text: None)
    folders = {role: resolved.agent.roles[role].model for role in ("solver", "checker")}
    assert len(set(folders.values())) == 2 and not resolved.model.warm_start
    assert resolved.model.name == config.model.name  # the run's tokenizer
    assert resolved.agent.roles["checker"].shaping == config.agent.roles["checker"].shaping
    for role, folder in folders.items():
        assert json.loads((Path(folder) / warm_start.MARKER).read_text())["role"] == role
    stages = {
        role: json.loads((Path(folder) / warm_start.MARKER).read_text())["sft"]["stages"]
        for role, folder in folders.items()
    }
    assert stages == {
        "solver": [{"steps": 1, "options": {"critique_copies": 1.0}, "learning_rate": None, "batch_size": None}],
        "checker": [],
    }  # the solver's own stages
    solver_prompts, checker_prompts = shown.values()  # in the order of task.roles: the solver's model first
    assert all("Proposed:" in prompt for prompt in checker_prompts)
    assert not any("Proposed:" in prompt for prompt in solver_prompts)
    again = warm_start.resolve_warm_start(config, task, root=tmp_path, log=lambda text: None)
    assert again == resolved and len(shown) == 2  # found in the cache, not trained again


def test_a_warm_start_of_a_roles_model_that_is_not_the_embedded_model_is_refused():
    from unipg.config import ConfigError

    with pytest.raises(ConfigError, match="agent.roles.checker.model is '/models/checker': run `unipg sft`"):
        load_config(CONFIGS / "solver_checker_tool_checker.yaml", ["agent.roles.checker.model=/models/checker"])


def test_the_solver_repeats_its_proposal_in_a_share_of_its_critique_demonstrations():
    from unipg.tasks.solver_checker import SOLVER

    options = dict(digits=3, num_train=200, num_test=2, solver_tool=False, tool_demonstrations=0.0)
    task = make_task("solver_checker", critique_demonstrations=1.0, critique_copies=0.25, **options)
    critiques = [
        solution
        for example in task.train
        for role, _, solution in task.role_demonstrations(example)
        if role == SOLVER and len(solution) == 3
    ]
    assert len(critiques) == len(task.train)  # one per example
    copied = [solution[2]["content"] == solution[1]["content"].removeprefix("REJECT: ") for solution in critiques]
    assert 0.15 < sum(copied) / len(copied) < 0.35
    assert all(  # the rest repeat the proposal, a sentence as the solver's first answers are
        solution[2]["content"] == solution[0]["content"] and solution[0]["content"].startswith("The answer is ")
        for solution, copy in zip(critiques, copied)
        if not copy
    )
    with pytest.raises(ValueError, match="critique_copies must be a fraction"):
        make_task("solver_checker", critique_copies=1.5, **options)


def test_a_critiqued_proposal_is_context_and_a_stage_can_leave_out_the_solvers_direct_answers():
    from unipg.tasks.solver_checker import SOLVER

    options = dict(digits=3, num_train=50, num_test=2, solver_tool=False, tool_demonstrations=0.0)
    task = make_task("solver_checker", critique_demonstrations=1.0, answer_demonstrations=0.0, **options)
    solver = [
        solution for example in task.train for role, _, solution in task.role_demonstrations(example) if role == SOLVER
    ]
    assert len(solver) == len(task.train) and all(len(solution) == 3 for solution in solver)  # critiques only
    assert all(solution[0]["weight"] == 0 and "weight" not in solution[2] for solution in solver)
    every = make_task("solver_checker", critique_demonstrations=1.0, **options)
    counts = [sum(role == SOLVER for role, _, _ in every.role_demonstrations(example)) for example in every.train]
    assert set(counts) == {2}  # by default each example also has the solver's direct answer
    with pytest.raises(ValueError, match="answer_demonstrations must be a fraction"):
        make_task("solver_checker", answer_demonstrations=-0.5, **options)


def test_a_roles_own_warm_start_stages_without_a_model_per_role_are_refused():
    from unipg.config import ConfigError

    with pytest.raises(ConfigError, match="agent.roles.solver.sft_stages is read with agent.role_policy=separate"):
        load_config(CONFIGS / "solver_checker.yaml", ["agent.roles.solver.sft_stages=[{steps: 5}]"])


def test_with_agreement_a_proposal_equal_to_the_checkers_answer_is_accepted_and_a_different_one_sent_back():
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
    service = EnvironmentService(build_tools([{"name": "calculator"}]), timeout=5.0)
    try:
        env = SolverCheckerEnv(
            build_rewards([{"name": "math"}]), service, solver_tool=False, agreement=True, shaping={CHECKER: 0.2}
        )
        guess, checked, sent_back, copy, agreed = run_turns(env, ["The answer is 418.", call, "408", "408", "408"])
        assert checked.observation.strip() == "408"  # the checker's call ran
        assert sent_back.observation == "408" and not sent_back.done  # the reply disagrees: back to the solver
        assert copy.info.next_role == CHECKER
        assert agreed.done and agreed.info.correct and agreed.info.extras["accepted"]
        assert agreed.info.role_rewards[CHECKER] == pytest.approx(1.0 + 0.2)  # both replies held the result
        # "ACCEPT" is no answer to agree with, so a wrong proposal is never accepted by it
        (*_, last) = run_turns(env, ["The answer is 418.", "ACCEPT", "The answer is 418.", "ACCEPT"])
        assert last.done and not last.info.extras["accepted"] and last.info.role_rewards[CHECKER] == 0.0
    finally:
        service.close()


def test_with_agreement_the_checkers_demonstrations_reply_with_the_result_in_every_round():
    options = dict(digits=3, num_train=20, num_test=2, solver_tool=False, tool_demonstrations=0.0)
    task = make_task("solver_checker", critique_demonstrations=1.0, agreement=True, **options)
    assert task.env_options["agreement"] is True
    for example in task.train:
        demonstrations = task.role_demonstrations(example)
        checks = [solution for role, _, solution in demonstrations if role == CHECKER]
        replies = [[m["content"] for m in solution if m["role"] == "assistant"][1:] for solution in checks]
        assert replies == [[example.answer], [example.answer, example.answer]]  # accepted; sent back, asked again
        critiques = [
            solution[1]["content"] for role, _, solution in demonstrations if len(solution) == 3 and role != CHECKER
        ]
        assert critiques == [example.answer]  # the solver is sent the result itself
    # asked again, the checker sees the solver's copy or its wrong proposal repeated, and replies with the result
    again = []
    for example in task.train:
        _, first, solution = [demo for demo in task.role_demonstrations(example) if demo[0] == CHECKER][1]
        proposed = solution[-2]["content"].rpartition("Proposed: ")[2]
        again.append("copied" if proposed == example.answer else "repeated")
        assert proposed in (example.answer, first_proposal(first))
    assert 5 <= again.count("repeated") <= 15  # about half of 20


def first_proposal(observation: str) -> str:
    return observation.rpartition("Proposed: ")[2]
