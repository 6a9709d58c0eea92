"""A solver and a checker on one problem: the solver proposes an answer, the checker accepts it or critiques it.

Turns: the solver works on the problem (it may call tools, whose outputs come back to it) until it writes an
answer without a call: its proposal. The checker then sees the problem and the proposal (it may call tools
too; with ``solver_tool=False`` only the checker's calls run, and a call the solver writes is its proposal as
it stands) and replies. A reply starting with ``ACCEPT`` ends the episode; any other reply is a critique, shown to
the solver, who answers again. After ``max_rounds`` critiques the episode ends unaccepted.

With ``agreement=True`` the checker does not give a verdict: it replies with the answer it vouches for (e.g. the
calculator's result), and the proposal is accepted when its final answer equals the checker's; otherwise the
reply goes to the solver as the critique. The comparison is then the protocol's, not a skill the checker learns.

Team reward, given to both roles: the task's reward of the proposal when an accepted proposal is correct,
``−wrong_accept_penalty`` when a wrong one was accepted, 0 when nothing was accepted. Optional per-role
shaping (``shaping: {role: weight}``) adds weight × a role's own term: the solver's, whether its last proposal
was correct; the checker's, the share of its verdicts that were right (accepting a correct proposal,
critiquing a wrong one), with ``agreement`` the share of its replies whose answer is correct.
"""

from __future__ import annotations

import dataclasses

from unipg.envs.base import ENVS, StepResult, TurnInfo, final_answer_reward
from unipg.envs.service import EnvironmentService
from unipg.envs.tool_env import parse_turn, tool_step
from unipg.policy.tool_calls import TOOL_PARSERS
from unipg.tasks.answers import extract_final_answer
from unipg.tasks.base import Example
from unipg.tasks.solver_checker import ACCEPT, CHECKER, SOLVER, checker_observation


class SolverCheckerEnv:
    """One solver–checker episode (module docstring)."""

    roles = (SOLVER, CHECKER)

    def __init__(
        self,
        reward_fn,
        service: EnvironmentService | None,
        *,
        max_rounds: int = 2,
        wrong_accept_penalty: float = 0.1,
        process_weight: float = 0.1,
        shaping: dict | None = None,
        tool_parser: str = "hermes",
        solver_tool: bool = True,
        agreement: bool = False,
    ):
        if max_rounds < 1:
            raise ValueError(f"solver_checker: max_rounds ({max_rounds}) must be ≥ 1 (checker verdicts per episode)")
        self.reward_fn, self.service, self.max_rounds = reward_fn, service, max_rounds
        self.wrong_accept_penalty, self.process_weight = wrong_accept_penalty, process_weight
        self.shaping = {role: float(weight) for role, weight in (shaping or {}).items()}
        self.parser = TOOL_PARSERS.get(tool_parser)()
        self.solver_tool, self.agreement = solver_tool, agreement
        self.example: Example | None = None

    async def reset(self, example: Example) -> tuple[str, str]:
        self.example, self.acting, self.rounds, self.paid = example, SOLVER, 0, {SOLVER: 0.0, CHECKER: 0.0}
        self.proposal_reward, self.proposal_correct, self.right_verdicts, self.proposal = 0.0, False, 0, ""
        return SOLVER, example.prompt

    async def step(self, action: str) -> StepResult:
        if self.example is None:
            raise RuntimeError("call reset() before step()")
        may_call = self.service is not None and (self.acting == CHECKER or self.solver_tool)
        turn = parse_turn(action, self.service, self.parser) if may_call else None
        if turn is not None and turn.kind != "answer":
            return await self._tool_step(turn)
        if self.acting == SOLVER:
            self.proposal_reward, info = await final_answer_reward(self.reward_fn, self.example, action)
            self.proposal_correct, self.proposal = info.correct, action
            self.acting = CHECKER
            return StepResult(
                checker_observation(self.example, action),
                0.0,
                False,
                TurnInfo(next_role=CHECKER, extras={"proposal_correct": self.proposal_correct}),
            )
        self.rounds += 1
        if self.agreement:
            vouched = extract_final_answer(action)
            accepted = vouched is not None and vouched == extract_final_answer(self.proposal)
            self.right_verdicts += (await final_answer_reward(self.reward_fn, self.example, action))[1].correct
        else:
            accepted = action.strip().upper().startswith(ACCEPT)
            self.right_verdicts += accepted == self.proposal_correct
        if accepted or self.rounds >= self.max_rounds:
            return StepResult("", 0.0, True, self._outcome(accepted))
        self.acting = SOLVER
        return StepResult(action.strip(), 0.0, False, TurnInfo(next_role=SOLVER, extras={"verdict": "critique"}))

    def _outcome(self, accepted: bool) -> TurnInfo:
        team = 0.0
        if accepted:
            team = self.proposal_reward if self.proposal_correct else -self.wrong_accept_penalty
        terms = {SOLVER: float(self.proposal_correct), CHECKER: self.right_verdicts / self.rounds}
        rewards = {role: team + self.shaping.get(role, 0.0) * terms[role] for role in self.roles}
        return TurnInfo(
            final=True,
            correct=accepted and self.proposal_correct,
            role_rewards=rewards,
            extras={"accepted": accepted, "verdict": "accept" if accepted else "critique", "team_reward": team},
        )

    async def _tool_step(self, turn) -> StepResult:
        """A tool call (or a malformed one) by the acting role: the output goes back to that role."""
        role = self.acting
        step, self.paid[role] = await tool_step(
            self.service, turn, paid=self.paid[role], process_weight=self.process_weight
        )  # once per role and episode
        return step._replace(info=dataclasses.replace(step.info, next_role=role, observation_role="tool"))


@ENVS.register("solver_checker")
def solver_checker_env(
    task,
    reward_fn,
    service: EnvironmentService | None,
    max_rounds: int = 2,
    wrong_accept_penalty: float = 0.1,
    process_weight: float = 0.1,
    shaping: dict | None = None,
    tool_parser: str = "hermes",
    solver_tool: bool = True,
    agreement: bool = False,
) -> SolverCheckerEnv:
    """``tool_parser``: the format calls are written in (``unipg.policy.tool_calls``); ``solver_tool``: whether
    the solver's calls run (False: only the checker's); ``agreement``: accept a proposal whose answer equals the
    checker's reply's (module docstring) instead of on the checker's ``ACCEPT``."""
    return SolverCheckerEnv(
        reward_fn,
        service,
        max_rounds=max_rounds,
        wrong_accept_penalty=wrong_accept_penalty,
        process_weight=process_weight,
        shaping=shaping,
        tool_parser=tool_parser,
        solver_tool=solver_tool,
        agreement=agreement,
    )
