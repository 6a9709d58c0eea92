"""A tool-calling agent environment: the policy answers or calls a tool, one call per turn.

The call format is the one OpenAI-style chat models (Qwen, Hermes) are trained on: a JSON object with the
function's name and arguments between tags, anywhere in the turn::

    <tool_call>{"name": "calculator", "arguments": {"expression": "4738*29"}}</tool_call>

A turn with a call gets the tool's output as the next observation (through the environment service:
timeouts, retries, default observation). A turn without ``<tool_call>`` is the final answer, scored by the
task's reward functions, and ends the episode. A malformed call (no closing tag, invalid JSON, unknown tool,
wrong arguments) is reported back as an observation saying what was wrong, so the policy can learn the format.

Process rewards: a valid call that the tool answers earns ``process_weight`` once per episode (so calling
more never pays more than answering); a malformed call costs ``process_weight``; a call that failed on
every attempt costs the service's ``failure_penalty``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from unipg.sample.envs.base import ENVS, StepResult, final_answer_reward
from unipg.sample.envs.service import EnvironmentService
from unipg.sample.tasks import Example
from unipg.sample.tools.base import CLOSE_TAG, OPEN_TAG



@dataclass
class ParsedTurn:
    """What a policy turn asked for."""

    kind: str  # "answer", "call" or "malformed"
    name: str | None = None
    arguments: dict | None = None
    error: str | None = None  # what was wrong with a malformed call, shown to the policy


def parse_turn(text: str, service: EnvironmentService) -> ParsedTurn:
    """Classify a turn as a final answer, a valid call of a known tool, or a malformed call."""
    start = text.find(OPEN_TAG)
    if start < 0:
        return ParsedTurn("answer")
    end = text.find(CLOSE_TAG, start)
    if end < 0:
        return ParsedTurn("malformed", error=f"the call has no closing {CLOSE_TAG}")
    body = text[start + len(OPEN_TAG): end].strip()
    try:
        call = json.loads(body)
    except json.JSONDecodeError as problem:
        return ParsedTurn("malformed", error=f"the call is not valid JSON ({problem.msg} at character {problem.pos})")
    if not isinstance(call, dict) or "name" not in call:
        return ParsedTurn("malformed", error='the call must be {"name": ..., "arguments": {...}}')
    name, arguments = call["name"], call.get("arguments", {})
    if name not in service.tools:
        return ParsedTurn("malformed", error=f"unknown tool '{name}'; available: {', '.join(sorted(service.tools))}")
    problem = service.tools[name].check_arguments(arguments)
    if problem:
        return ParsedTurn("malformed", name=name, error=f"{name}: {problem}")
    return ParsedTurn("call", name, arguments)


class ToolEnv:
    """One episode of a task whose policy may call tools before answering."""

    observation_role = "tool"

    def __init__(self, reward_fn, service: EnvironmentService, *, process_weight: float = 0.1):
        self.reward_fn, self.service, self.process_weight = reward_fn, service, process_weight
        self.example: Example | None = None
        self._process_paid = 0.0

    async def reset(self, example: Example) -> str:
        self.example, self._process_paid = example, 0.0
        return example.prompt

    async def step(self, action: str) -> StepResult:
        if self.example is None:
            raise RuntimeError("call reset() before step()")
        turn = parse_turn(action, self.service)
        if turn.kind == "answer":
            reward, info = await final_answer_reward(self.reward_fn, self.example, action)
            return StepResult("", reward, True, info)
        if turn.kind == "malformed":
            info = {"tool": turn.name, "tool_status": "malformed", "process_reward": -self.process_weight}
            return StepResult(f"error: {turn.error}", -self.process_weight, False, info)
        result = await self.service.call(turn.name, turn.arguments)
        process = 0.0
        if result.ok and self._process_paid < self.process_weight:
            process = self.process_weight - self._process_paid
            self._process_paid = self.process_weight
        info = {"tool": turn.name, "tool_status": result.status, "attempts": result.attempts,
                "timeouts": result.timeouts, "tool_seconds": result.seconds, "process_reward": process}
        return StepResult(result.observation, process + result.penalty, False, info)


@ENVS.register("tool")
def tool_env(task, reward_fn, service: EnvironmentService, process_weight: float = 0.1) -> ToolEnv:
    return ToolEnv(reward_fn, service, process_weight=process_weight)
