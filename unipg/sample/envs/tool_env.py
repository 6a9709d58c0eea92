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
from unipg.sample.tasks.base import Example
from unipg.sample.tools.base import CLOSE_TAG, OPEN_TAG


@dataclass
class ParsedTurn:
    """What a policy turn asked for."""

    kind: str  # "answer", "call" or "malformed"
    name: str | None = None
    arguments: dict | None = None
    error: str | None = None  # what was wrong with a malformed call, shown to the policy


def parse_turn(text: str, service: EnvironmentService) -> ParsedTurn:
    """Classify a turn as a final answer, a valid call of a known tool, or a malformed call; never raises.

    The call is the first ``<tool_call>`` and the JSON object after it. It ends at the first ``</tool_call>``,
    or, when the text up to there is not valid JSON, at the end of the JSON object if ``</tool_call>`` follows
    it: so a string argument may itself contain the closing tag (code that prints it, say).
    """
    start = text.find(OPEN_TAG)
    if start < 0:
        return ParsedTurn("answer")
    end = text.find(CLOSE_TAG, start)
    if end < 0:
        return ParsedTurn("malformed", error=f"the call has no closing {CLOSE_TAG}")
    call, problem = _call_json(text, start + len(OPEN_TAG), end)
    if problem:
        return ParsedTurn("malformed", error=problem)
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ParsedTurn("malformed", error='the call must be {"name": "<tool>", "arguments": {...}}')
    name, arguments = call["name"], call.get("arguments", {})
    if name not in service.tools:
        shown = name if len(name) <= 40 else name[:40] + "..."
        return ParsedTurn("malformed", error=f"unknown tool '{shown}'; available: {', '.join(sorted(service.tools))}")
    problem = service.tools[name].check_arguments(arguments)
    if problem:
        return ParsedTurn("malformed", name=name, error=f"{name}: {problem}")
    return ParsedTurn("call", name, arguments)


def _call_json(text: str, body_start: int, first_close: int) -> tuple[object, str | None]:
    """(the JSON value of the call whose body starts at ``body_start``, None), or (None, what is wrong)."""
    call, problem = _read_json(lambda: json.loads(text[body_start:first_close].strip()))
    if problem is None or problem == _TOO_DEEP:
        return call, problem
    body_start = len(text) - len(text[body_start:].lstrip())  # the first character after the spaces
    decoded, _ = _read_json(lambda: _DECODER.raw_decode(text, body_start))
    if decoded is not None and text[decoded[1]:].lstrip().startswith(CLOSE_TAG):
        return decoded[0], None
    return None, problem


_TOO_DEEP = "the call is nested too deeply to be read as JSON"


def _read_json(decode) -> tuple[object, str | None]:
    """(what ``decode()`` returns, None), or (None, what is wrong with the text): any policy text is read
    without raising, whatever ``json`` raises on it (a decode error, nesting past the recursion limit, an
    integer longer than Python's int-string conversion limit)."""
    try:
        return decode(), None
    except json.JSONDecodeError as error:
        return None, f"the call is not valid JSON ({error.msg} at character {error.pos})"
    except RecursionError:  # nesting deeper than the interpreter's recursion limit
        return None, _TOO_DEEP
    except ValueError as error:
        if "integer string conversion" in str(error):
            return None, "the call holds an integer with too many digits to read"
        return None, f"the call is not valid JSON ({str(error)[:80]})"


_DECODER = json.JSONDecoder()


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
            observation = f"error: {turn.error}"
            info = {"tool": turn.name, "tool_status": "malformed", "process_reward": -self.process_weight,
                    "observation": observation}
            return StepResult(observation, -self.process_weight, False, info)
        result = await self.service.call(turn.name, turn.arguments)
        process = 0.0
        if result.ok and self._process_paid < self.process_weight:
            process = self.process_weight - self._process_paid
            self._process_paid = self.process_weight
        info = {"tool": turn.name, "arguments": turn.arguments, "tool_status": result.status,
                "attempts": result.attempts, "timeouts": result.timeouts, "tool_seconds": result.seconds,
                "process_reward": process, "observation": result.observation}
        return StepResult(result.observation, process + result.penalty, False, info)


@ENVS.register("tool")
def tool_env(task, reward_fn, service: EnvironmentService, process_weight: float = 0.1) -> ToolEnv:
    return ToolEnv(reward_fn, service, process_weight=process_weight)
