"""A small MCP server for the tests, written with the MCP SDK and served over stdio.

Run as ``python mcp_server.py [pid_file]``: it appends its process id to ``pid_file`` (so a test can check that
every server started is gone after the run) and serves ``add``, ``lookup``, ``slow`` and ``fail``. With
``--garbage N`` it first writes N lines that are not protocol messages to stdout (a server that prints its logs
there); with ``--mute`` as well, it then never answers.
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
    arguments = sys.argv[1:]
    if "--garbage" in arguments:
        lines = int(arguments.pop(arguments.index("--garbage") + 1))
        arguments.remove("--garbage")
        for index in range(lines):
            print(f"starting up, step {index}", flush=index == lines - 1)
    if "--mute" in arguments:
        sys.stdin.read()  # until the client ends the session
        sys.exit(0)
    if arguments:
        with open(arguments[0], "a") as pid_file:
            pid_file.write(f"{os.getpid()}\n")
    server.run()
