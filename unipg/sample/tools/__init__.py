"""Built-in tools (calculator, unit conversion, Python sandbox, document search, the tools of an MCP server) and the
``TOOLS`` registry."""

from unipg.sample.tools import calculator, faulty, mcp, retrieval, sandbox, units  # noqa: F401  (register the built-in tools)
from unipg.sample.tools.base import TOOLS, LatencyModel, Tool, ToolError, tool

__all__ = ["TOOLS", "LatencyModel", "Tool", "ToolError", "tool"]
