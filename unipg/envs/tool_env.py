"""A tool-calling agent environment: the policy answers or calls a tool, one call per turn.

The call format is the model family's (``tool_parser``, see ``unipg.policy.tool_calls``); by default the
one Qwen and Hermes models are trained on, a JSON object with the function's name and arguments between tags,
anywhere in the turn::

    <tool_call>{"name": "calculator", "arguments": {"expression": "4738*29"}}</tool_call>

A turn with a call gets the tool's output as the next observation (through the environment service:
timeouts, retries, default observation). A turn without a call is the final answer, scored by the task's
reward functions, and ends the episode. A malformed call (no closing tag, invalid JSON, unknown tool,
wrong arguments) is reported back as an observation saying what was wrong, so the policy can learn the format.

Process rewards: a valid call that the tool answers earns ``process_weight`` once per episode (so calling
more never pays more than answering); a malformed call costs ``process_weight``; a call that failed on
every attempt costs the service's ``failure_penalty``.
"""

from __future__ import annotations

from dataclasses import dataclass

from unipg.envs.base import ENVS, StepResult, TurnInfo, final_answer_reward
from unipg.envs.service import EnvironmentService
from unipg.policy.tool_calls import TOOL_PARSERS, Hermes, MalformedToolCall
from unipg.tasks.base import Example


@dataclass
class ParsedTurn:
    """What a policy turn asked for."""

    kind: str  # "answer", "call" or "malformed"
    name: str | None = None
    arguments: dict | None = None
    error: str | None = None  # what was wrong with a malformed call, shown to the policy


def parse_turn(text: str, service: EnvironmentService, parser=None) -> ParsedTurn:
    """Classify a turn as a final answer, a valid call of a known tool, or a malformed call; never raises.

    ``parser`` reads the calls (``unipg.policy.tool_calls``; default ``hermes``); the turn's first call is the
    one made.
    """
    try:
        calls = (parser or _HERMES).parse_tool_calls(text)
    except MalformedToolCall as problem:
        return ParsedTurn("malformed", error=str(problem))
    if not calls:
        return ParsedTurn("answer")
    name, arguments = calls[0].name, calls[0].arguments
    if name not in service.tools:
        shown = name if len(name) <= 40 else name[:40] + "..."
        return ParsedTurn("malformed", error=f"unknown tool '{shown}'; available: {', '.join(sorted(service.tools))}")
    problem = service.tools[name].check_arguments(arguments)
    if problem:
        return ParsedTurn("malformed", name=name, error=f"{name}: {problem}")
    return ParsedTurn("call", name, arguments)


_HERMES = Hermes()


class ToolEnv:
    """One episode of a task whose policy may call tools before answering."""

    observation_role = "tool"

    def __init__(
        self, reward_fn, service: EnvironmentService, *, process_weight: float = 0.1, tool_parser: str = "hermes"
    ):
        self.reward_fn, self.service, self.process_weight = reward_fn, service, process_weight
        self.parser = TOOL_PARSERS.get(tool_parser)()
        self.example: Example | None = None
        self._process_paid = 0.0

    async def reset(self, example: Example) -> str:
        self.example, self._process_paid = example, 0.0
        return example.prompt

    async def step(self, action: str) -> StepResult:
        if self.example is None:
            raise RuntimeError("call reset() before step()")
        turn = parse_turn(action, self.service, self.parser)
        if turn.kind == "answer":
            reward, info = await final_answer_reward(self.reward_fn, self.example, action)
            return StepResult("", reward, True, info)
        step, self._process_paid = await tool_step(
            self.service, turn, paid=self._process_paid, process_weight=self.process_weight
        )
        return step


async def tool_step(
    service: EnvironmentService, turn, *, paid: float, process_weight: float
) -> tuple[StepResult, float]:
    """A turn that calls a tool (or tries to, malformed): run it through ``service``; the step and the process
    reward paid so far. A successful call pays up to ``process_weight`` once per episode (``paid`` of it already);
    a malformed one costs ``process_weight``."""
    if turn.kind == "malformed":
        observation = f"error: {turn.error}"
        info = TurnInfo(
            tool=turn.name, tool_status="malformed", process_reward=-process_weight, observation=observation
        )
        return StepResult(observation, -process_weight, False, info), paid
    result = await service.call(turn.name, turn.arguments)
    process = 0.0
    if result.ok and paid < process_weight:
        process, paid = process_weight - paid, process_weight
    info = TurnInfo(
        tool=turn.name,
        arguments=turn.arguments,
        tool_status=result.status,
        attempts=result.attempts,
        timeouts=result.timeouts,
        tool_seconds=result.seconds,
        process_reward=process,
        observation=result.observation,
    )
    return StepResult(result.observation, process + result.penalty, False, info), paid


@ENVS.register("tool")
def tool_env(
    task, reward_fn, service: EnvironmentService, process_weight: float = 0.1, tool_parser: str = "hermes"
) -> ToolEnv:
    """``tool_parser``: the format calls are written in (``unipg.policy.tool_calls``)."""
    return ToolEnv(reward_fn, service, process_weight=process_weight, tool_parser=tool_parser)
