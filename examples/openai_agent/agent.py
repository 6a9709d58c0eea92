"""A calculator agent written with the OpenAI Agents SDK, trained by unipg through its OpenAI-compatible endpoint.

Nothing here knows about unipg: the agent receives a base URL and an API key, as it would for any
OpenAI-compatible server, and returns its final answer, which unipg scores with the task's rewards.
Train it with ``unipg train --config examples/openai_agent/calculator.yaml``.
"""

from __future__ import annotations

import ast
import operator
import ssl

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

set_tracing_disabled(True)  # nothing leaves the machine
TLS = ssl.create_default_context()  # built once: loading the CA bundle costs about 0.1 s of CPU per client

_OPERATIONS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATIONS:
        return _OPERATIONS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    raise ValueError("only integers and + - * are supported")


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: integers with + - * and parentheses, e.g. "4738*29".
    """
    try:
        return str(_value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError) as error:
        return f"error: {error}"


async def run(base_url: str, api_key: str, example) -> str:
    """One episode: the question in, the agent's final answer out."""
    async with AsyncOpenAI(
        base_url=base_url, api_key=api_key, max_retries=0, http_client=DefaultAsyncHttpxClient(verify=TLS)
    ) as client:
        agent = Agent(
            name="calculator", tools=[calculator], model=OpenAIChatCompletionsModel(model="unipg", openai_client=client)
        )
        result = await Runner.run(agent, example.prompt, max_turns=3)
    return str(result.final_output)
