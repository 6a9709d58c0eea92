"""Built-in tools (calculator, unit conversion, Python sandbox, document search, the tools of an MCP server) and the
``TOOLS`` registry;
the tool-call formats a policy writes are ``TOOL_PARSERS``. Plugins import from here:
``from unipg.tools import TOOLS, tool, ToolError``."""

from unipg.tools import calculator, faulty, mcp, retrieval, sandbox, units  # noqa: F401  (register the built-in tools)
from unipg.policy.tool_calls import TOOL_PARSERS
from unipg.tools.base import TOOLS, LatencyModel, Tool, ToolError, format_tool_call, tool

__all__ = ["TOOLS", "TOOL_PARSERS", "LatencyModel", "Tool", "ToolError", "format_tool_call", "tool"]
