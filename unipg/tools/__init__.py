"""Built-in tools (calculator, unit conversion, Python sandbox, document search, the tools of an MCP server) and the
``TOOLS`` registry;
the tool-call formats a policy writes are ``TOOL_PARSERS`` (a format reads a turn into ``ToolCall``s, or raises
``MalformedToolCall``). Plugins import from here:
``from unipg.tools import TOOLS, tool, ToolError``."""

from unipg.policy.tool_calls import TOOL_PARSERS, MalformedToolCall, ToolCall
from unipg.tools import calculator, faulty, mcp, retrieval, sandbox, units  # noqa: F401  (register the built-in tools)
from unipg.tools.base import TOOLS, LatencyModel, Tool, ToolError, format_tool_call, names_its_tools, tool

__all__ = [
    "TOOLS",
    "TOOL_PARSERS",
    "LatencyModel",
    "MalformedToolCall",
    "Tool",
    "ToolCall",
    "ToolError",
    "format_tool_call",
    "names_its_tools",
    "tool",
]
