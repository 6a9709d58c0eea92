import asyncio

import pytest
import torch

from unipg.config import ConfigError, load_config
from unipg.envs import ENVS, EnvironmentService, TurnInfo
from unipg.envs.service import build_tools
from unipg.envs.solver_checker import SolverCheckerEnv
from unipg.learn.lm_batch import LMBatch, lm_advantages
from unipg.policy.loading import load_lm_policy
from unipg.runtime.backends.local_lm import split_groups
from unipg.runtime.lm import group_index
from unipg.sample.agent import Trajectory
from unipg.sample.episodes import EpisodeRunner, demonstration_pairs
from unipg.tasks.base import Example, make_task
from unipg.tasks.rewards.rules import build_rewards
from unipg.tasks.solver_checker import checker_observation
from unipg.tools.base import format_tool_call

PROBLEM = Example("What is 12*34?", "408", "", {"answer": "408"})
CALL = format_tool_call("calculator", {"expression": "12*34"})
TINY = [
    "task.name=solver_checker",
    "task.options={digits: 2, num_train: 30, num_test: 4}",
    "sample.samples_per_prompt=2",
    "sample.max_new_tokens=12",
    "agent.max_total_tokens=48",
    "train.batch_size=4",
    "train.mini_batch_size=4",
    "train.micro_batch_size=8",
    "train.updates=2",
    "eval.every_updates=2",
    "eval.pass_k=0",
    "log.progress=false",
    "log.tensorboard=false",
    "algorithm=grpo",
]


def play(env: SolverCheckerEnv, actions: list[str]) -> list:
    async def episode():
        steps = [await env.reset(PROBLEM)]
        for action in actions:
            steps.append(await env.step(action))
        return steps

    return asyncio.run(episode())


def make_env(**options) -> SolverCheckerEnv:
    service = EnvironmentService(build_tools([{"name": "calculator"}]), timeout=5.0)
    return SolverCheckerEnv(build_rewards([{"name": "math"}]), service, **options)


def test_turns_alternate_and_an_accepted_correct_answer_pays_the_team():
    steps = play(make_env(), [CALL, "408", CALL, "ACCEPT"])
    assert steps[0] == ("solver", PROBLEM.prompt)
    assert steps[1].observation == "408" and steps[1].info.next_role == "solver"
    assert steps[1].info.observation_role == "tool" and steps[1].reward == pytest.approx(0.1)
    assert steps[2].info.next_role == "checker" and steps[2].observation == "What is 12*34? Proposed: 408"
    assert steps[3].info.next_role == "checker"  # the checker's own calculator call comes back to it
    final = steps[4]
    assert final.done and final.info.correct and final.info.role_rewards == {"solver": 1.0, "checker": 1.0}


def test_a_critique_goes_back_to_the_solver_and_accepting_a_wrong_answer_costs_the_team():
    steps = play(make_env(max_rounds=2, shaping={"checker": 0.5}), ["418", "REJECT: 408", "407", "ACCEPT"])
    assert steps[2].observation == "REJECT: 408" and steps[2].info.next_role == "solver"
    final = steps[4]
    assert final.done and not final.info.correct and final.info.extras["team_reward"] == -0.1
    # the checker was right once (critiqued 418) and wrong once (accepted 407): shaping 0.5 × 1/2
    assert final.info.role_rewards == {"solver": -0.1, "checker": pytest.approx(-0.1 + 0.25)}


def test_nothing_accepted_within_the_rounds_ends_the_episode_unrewarded():
    final = play(make_env(max_rounds=1), ["408", "no"])[-1]
    assert final.done and final.info.role_rewards == {"solver": 0.0, "checker": 0.0}


def test_adapters_without_lora_and_unknown_roles_are_config_errors(embedded_path):
    with pytest.raises(ConfigError, match=r"agent.role_policy=adapters .* set model.lora_rank \(e.g. 8\)"):
        load_config(None, TINY + ["agent.role_policy=adapters"])
    config = load_config(None, TINY + ["agent.roles={judge: {shaping: 1.0}}", f"model.name={embedded_path}"])
    task = make_task("solver_checker", digits=2, num_train=30, num_test=4)
    with pytest.raises(ConfigError, match="judge, not a role of task 'solver_checker'"):
        EpisodeRunner(load_lm_policy(embedded_path), task, config, build_rewards(task.rewards))


def test_each_role_gets_an_ordinary_masked_trajectory_of_its_own_conversation(embedded_path):
    config = load_config(None, TINY + [f"model.name={embedded_path}", "agent.roles={checker: {system_prompt: judge}}"])
    task = make_task("solver_checker", digits=2, num_train=30, num_test=4)
    runner = EpisodeRunner(load_lm_policy(embedded_path), task, config, build_rewards(task.rewards))
    try:
        trajectories = runner.run(
            task.train[:3], generator=torch.Generator().manual_seed(0), policy_version=7, all_roles=True
        ).trajectories
    finally:
        runner.close()
    assert [t.role for t in trajectories] == ["solver", "checker"] * 3
    for trajectory in trajectories:
        assert len(trajectory.loss_mask) == len(trajectory.token_ids) == len(trajectory.behaviour_logprobs)
        assert trajectory.policy_versions == [7] * trajectory.turns and len(trajectory.step_rewards) == trajectory.turns
        sampled = [i for i, m in enumerate(trajectory.loss_mask) if m]
        assert all(trajectory.turn_of_token[i] >= 0 for i in sampled)
        assert all(
            trajectory.behaviour_logprobs[i] == 0.0 for i in range(len(trajectory.token_ids)) if i not in sampled
        )
    checker = runner.role_encoders["checker"]
    assert checker.system_prompt == "judge" and runner.role_encoders["solver"].system_prompt == "solve"
    for solver, judge in zip(trajectories[::2], trajectories[1::2]):
        proposals = [text for text, info in zip(solver.turn_texts, solver.infos) if "proposal_correct" in info.extras]
        assert bool(judge.turns) == bool(proposals)  # the checker acts once the solver proposed something
        if proposals:  # the checker's prompt is its first observation: the problem and the first proposal
            assert judge.prompt_ids == checker(checker_observation(solver.example, proposals[0]))


def test_groups_lay_out_roles_so_that_group_advantages_compare_one_role_on_one_prompt():
    def trajectory(role, reward):
        t = Trajectory(PROBLEM, [5], role=role)
        t.add_sampled([6, 7], [-1.0, -1.0], 0)
        t.turn_texts, t.step_rewards, t.policy_versions, t.infos = ["x"], [reward], [0], [TurnInfo()]
        return t

    episodes = [
        trajectory("solver", 1.0),
        trajectory("checker", 10.0),
        trajectory("solver", 0.0),
        trajectory("checker", 20.0),
    ]
    (group,) = split_groups(episodes, version=0, size=2, roles=2)
    assert [t.role for t in group.items] == ["solver", "solver", "checker", "checker"] and group.size == 2
    batch = LMBatch.from_trajectories(group.items, pad_id=0)
    config = load_config(None, TINY + ["estimator.normalize_advantages=false"])
    advantages, _ = lm_advantages(batch, config.estimator, group_size=2, kl_coef=0.0)
    per_row = advantages[:, 0].tolist()
    assert per_row[0] > 0 > per_row[1] and per_row[2] < 0 < per_row[3]  # each role against its own group
    assert per_row[0] == pytest.approx(-per_row[1]) and per_row[2] == pytest.approx(-per_row[3])
    assert group_index([group]) == [0, 0, 1, 1]  # the explicit group index the runtime gives the learner
    indexed = LMBatch.from_trajectories(group.items, pad_id=0, groups=group_index([group]))
    assert torch.equal(lm_advantages(indexed, config.estimator, group_size=2, kl_coef=0.0)[0], advantages)


def test_warm_start_demonstrations_cover_both_roles_with_their_prompts(embedded_path):
    config = load_config(None, TINY)
    task = make_task("solver_checker", digits=2, num_train=30, num_test=4)
    tokenizer = load_lm_policy(embedded_path).tokenizer
    pairs = demonstration_pairs(tokenizer, task, config, task.train[:4])
    prompts = [prompt for prompt, _ in pairs]
    assert sum("solve" in p for p in prompts) >= 4 and sum("check" in p for p in prompts) == 8
    assert any("ACCEPT" in "".join(text for text, _ in completion) for _, completion in pairs)
    assert "solver_checker" in ENVS
