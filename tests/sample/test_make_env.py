"""Which environment an episode runs in: ``task.env`` from the config, else the task's own, else ``tool`` for a task
with tools and ``single_turn`` for one without (``EpisodeRunner.make_env``)."""

from __future__ import annotations

import pytest

from unipg.config import load_config
from unipg.envs.single_turn import SingleTurnEnv
from unipg.envs.solver_checker import SolverCheckerEnv
from unipg.envs.tool_env import ToolEnv
from unipg.sample.episodes import EpisodeRunner
from unipg.tasks.base import make_task
from unipg.tasks.rewards.rules import build_rewards

ARITHMETIC = ["task.name=arithmetic", "task.options={digits: 1, num_train: 4, num_test: 2}"]
CALCULATOR = ["task.name=calculator", "task.options={digits: 1, num_train: 4, num_test: 2}"]
SOLVER_CHECKER = ["task.name=solver_checker", "task.options={digits: 1, num_train: 4, num_test: 2, max_rounds: 1}"]


@pytest.fixture(scope="module")
def policy(tiny_policy):
    return tiny_policy()


def environment(policy, *overrides: str):
    """The environment ``make_env`` builds for a run of ``overrides``."""
    config = load_config(None, ["algorithm=grpo", "log.progress=false", *overrides])
    task = make_task(config.task.name, **config.task.options)
    runner = EpisodeRunner(policy, task, config, build_rewards(task.rewards))
    try:
        return runner.make_env()
    finally:
        runner.close()


def test_without_task_env_a_task_runs_in_its_own_environment_or_the_default_one(policy):
    assert isinstance(environment(policy, *ARITHMETIC), SingleTurnEnv)
    tool = environment(policy, *CALCULATOR, "agent.process_weight=0.3", "model.tool_parser=llama3_json")
    assert isinstance(tool, ToolEnv) and tool.process_weight == 0.3 and type(tool.parser).__name__ == "Llama3Json"
    checker = environment(policy, *SOLVER_CHECKER, "agent.roles={checker: {shaping: 0.2}}")
    assert isinstance(checker, SolverCheckerEnv) and checker.max_rounds == 1 and checker.shaping == {"checker": 0.2}


def test_task_env_chooses_the_environment_and_its_options_fill_in_over_the_tasks_own(policy):
    tool = environment(policy, *CALCULATOR, "task.env=tool", "task.env_options={process_weight: 0.25}")
    assert isinstance(tool, ToolEnv) and tool.process_weight == 0.25
    assert isinstance(environment(policy, *CALCULATOR, "task.env=single_turn"), SingleTurnEnv)
    same = environment(
        policy, *SOLVER_CHECKER, "task.env=solver_checker", "task.env_options={wrong_accept_penalty: 0.5}"
    )
    assert same.max_rounds == 1 and same.wrong_accept_penalty == 0.5  # the task's max_rounds is kept
