"""A calculator agent written with the OpenAI Agents SDK, trained by unipg through its OpenAI-compatible endpoint.

Nothing here knows about unipg: the agent receives a base URL and an API key, as it would for any
OpenAI-compatible server, and returns its final answer, which unipg scores with the task's rewards. Every
episode gets the same base URL and a key of its own, so the agent keeps one client (one per event loop: its
connections belong to the loop that opened them) and gives each episode a copy with that episode's key.
Train it with ``unipg train --config examples/openai_agent/calculator.yaml``.
"""

from __future__ import annotations

import ast
import asyncio
import operator
import ssl
import weakref

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

set_tracing_disabled(True)  # nothing leaves the machine
TLS = ssl.create_default_context()  # built once: loading the CA bundle costs about 0.1 s of CPU per client
CLIENTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncOpenAI] = weakref.WeakKeyDictionary()

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


def shared_client(base_url: str) -> AsyncOpenAI:
    """The client of every episode on the running event loop (they share ``base_url``; each sets its own key)."""
    loop = asyncio.get_running_loop()
    if loop not in CLIENTS:
        CLIENTS[loop] = AsyncOpenAI(
            base_url=base_url, api_key="set per episode", max_retries=0, http_client=DefaultAsyncHttpxClient(verify=TLS)
        )
    return CLIENTS[loop]


async def run(base_url: str, api_key: str, example) -> str:
    """One episode: the question in, the agent's final answer out."""
    client = shared_client(base_url).with_options(api_key=api_key)
    agent = Agent(
        name="calculator", tools=[calculator], model=OpenAIChatCompletionsModel(model="unipg", openai_client=client)
    )
    result = await Runner.run(agent, example.prompt, max_turns=3)
    return str(result.final_output)
