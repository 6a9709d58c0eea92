"""Built-in tools (calculator, unit conversion, Python sandbox, document search) and the ``TOOLS`` registry."""

from unipg.sample.tools import calculator, faulty, retrieval, sandbox, units  # noqa: F401  (register the built-in tools)
from unipg.sample.tools.base import TOOLS, LatencyModel, Tool, ToolError, tool

__all__ = ["TOOLS", "LatencyModel", "Tool", "ToolError", "tool"]
