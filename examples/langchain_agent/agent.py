"""A calculator agent written with LangChain, trained by unipg through its OpenAI-compatible endpoint.

Nothing here knows about unipg: the agent receives a base URL and an API key, as it would for any
OpenAI-compatible server, and returns its final answer, which unipg scores with the task's rewards. It is a
plain LangChain tool-calling loop: ``ChatOpenAI(...).bind_tools([...])``, the tool run by LangChain, its
``ToolMessage`` sent back. Its first turn binds the tool with ``tool_choice="any"`` (sent as ``"required"``), so
the model must call the calculator before it answers; the endpoint samples that call under the constraint.
``ChatOpenAI`` keeps one HTTP connection pool per base URL for the whole process, and every episode has the same
base URL, so building a model per episode with that episode's key costs no new connection.
Train it with ``unipg train --config examples/langchain_agent/calculator.yaml``.
"""

from __future__ import annotations

import ast
import operator

from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

MAX_TURNS = 3  # model calls per episode at most
_OPERATIONS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATIONS:
        return _OPERATIONS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    raise ValueError("only integers and + - * are supported")


@tool
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
    """One episode: the question in, the model's last reply out."""
    model = ChatOpenAI(model="unipg", base_url=base_url, api_key=api_key, max_retries=0)
    first_turn, later_turns = model.bind_tools([calculator], tool_choice="any"), model.bind_tools([calculator])
    messages = [HumanMessage(example.prompt)]
    for turn in range(MAX_TURNS):
        reply = await (first_turn if turn == 0 else later_turns).ainvoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            output = (
                await calculator.ainvoke(call["args"]) if call["name"] == calculator.name else "error: no such tool"
            )
            messages.append(ToolMessage(output, tool_call_id=call["id"]))
    return reply.text
