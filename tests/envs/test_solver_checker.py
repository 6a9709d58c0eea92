"""The solver–checker team's task and environment: what the checker is shown, and the config the team trains
with beside the solver alone."""

import asyncio
from pathlib import Path

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
