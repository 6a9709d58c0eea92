"""A small MCP server for the tests, written with the MCP SDK and served over stdio.

Run as ``python mcp_server.py [pid_file]``: it appends its process id to ``pid_file`` (so a test can check that
every server started is gone after the run) and serves ``add``, ``lookup``, ``slow`` and ``fail``.
"""

import asyncio
import os
import sys

try:
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
except ImportError:  # the SDK's names before version 2
    from mcp.server.fastmcp import FastMCP as MCPServer
    from mcp.server.fastmcp.exceptions import ToolError

WORDS = {"apple": "a round fruit", "lima": "the capital of Peru"}

server = MCPServer("unipg-test", log_level="CRITICAL")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def lookup(word: str) -> str:
    """The meaning of a word."""
    if word not in WORDS:
        raise ToolError(f"no entry for {word!r}")  # a refusal, shown to the caller
    return WORDS[word]


@server.tool()
async def slow(seconds: float) -> str:
    """Answer after a delay."""
    await asyncio.sleep(seconds)
    return "done"


@server.tool()
def fail() -> str:
    """Always raises, so the server reports an error result."""
    raise RuntimeError("this tool always fails")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        with open(sys.argv[1], "a") as pid_file:
            pid_file.write(f"{os.getpid()}\n")
    server.run()
