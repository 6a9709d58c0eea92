"""A calculator agent written with litellm, trained by unipg through its OpenAI-compatible endpoint.

Nothing here knows about unipg: the agent receives a base URL and an API key, as it would for any
OpenAI-compatible server, and returns its final answer, which unipg scores with the task's rewards. It calls
``litellm.acompletion`` with the ``openai/`` provider prefix (any OpenAI-compatible server), the episode's base
URL and key, and OpenAI tool schemas; its first turn sends ``tool_choice="required"``, so the model computes
with the calculator before it answers.

litellm is told to stay on this machine before it is imported: its model cost map is the copy it ships
(``LITELLM_LOCAL_MODEL_COST_MAP``), it reads no ``.env`` file (``LITELLM_MODE=PRODUCTION``), and it has no
logging callbacks and no telemetry. Train it with ``unipg train --config examples/litellm_agent/calculator.yaml``.
"""

from __future__ import annotations

import ast
import json
import operator
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_MODE", "PRODUCTION")

import litellm  # noqa: E402 — configured by the environment above, read when it is imported

litellm.telemetry = False
litellm.success_callback, litellm.failure_callback, litellm.callbacks = [], [], []

MAX_TURNS = 3  # model calls per episode at most
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression exactly.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {
                        "type": "string",
                        "description": 'integers with + - * and parentheses, e.g. "4738*29"',
                    }
                },
                "required": ["expression"],
            },
        },
    }
]
_OPERATIONS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATIONS:
        return _OPERATIONS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    raise ValueError("only integers and + - * are supported")


def calculator(arguments: str) -> str:
    """The calculator's output for a call's JSON arguments (``{"expression": ...}``); a bad call is an error text."""
    try:
        expression = json.loads(arguments)["expression"]
        return str(_value(ast.parse(expression, mode="eval").body))
    except (ValueError, KeyError, TypeError, SyntaxError) as error:
        return f"error: {error}"


async def run(base_url: str, api_key: str, example) -> str:
    """One episode: the question in, the model's last reply out."""
    messages = [{"role": "user", "content": example.prompt}]
    for turn in range(MAX_TURNS):
        response = await litellm.acompletion(
            model="openai/unipg",
            api_base=base_url,
            api_key=api_key,
            messages=messages,
            tools=TOOLS,
            tool_choice="required" if turn == 0 else "auto",
            num_retries=0,
        )
        reply = response.choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            output = (
                calculator(call.function.arguments) if call.function.name == "calculator" else "error: no such tool"
            )
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return reply.content or ""
