"""Tools served by an MCP server: every tool the server lists becomes a unipg ``Tool``.

A tool spec ``{name: mcp, server: {command: python, args: [server.py], env: {...}}, options: {include: [add]}}``
starts the server as a child process speaking MCP over stdio (the ``mcp`` SDK's ``stdio_client`` and
``ClientSession``), lists its tools, and hands each to the environment service under its own name, with the
server's JSON schema as its parameters. Calls then go through the service like any other tool's: timeouts,
retries, the default observation and the failure penalty apply. A result the server marks as an error
(``is_error``: the tool ran and refused) is a ``ToolError``, shown to the agent and not retried.

The MCP session is bound to one event loop, but episodes run on several (one per ``asyncio.run``, one per
worker thread), so the session lives on a loop of its own, on a daemon thread; calls from any loop are handed
to it and awaited there. ``close()`` (the environment service calls it when the run ends, and an ``atexit``
hook when a process forgets) ends the session, and the SDK stops the server's whole process tree.

A server that writes anything but protocol messages to stdout (its logs, a stray ``print``) would make the SDK
log a traceback for every such line; ``StdoutNoise`` keeps the first of them, as one line naming the server and
the line, and counts the rest, which the server's start-up error or its ``close()`` then reports in one line.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import threading
from typing import Any

from unipg.tools.base import TOOLS, Tool, ToolError, names_its_tools

SERVER_KEYS = ("command", "args", "env", "cwd")
_SDK_LOGGER = "mcp.client.stdio"  # logs "Failed to parse JSONRPC message from server" for every bad stdout line
_log = logging.getLogger(__name__)


class StdoutNoise(logging.Filter):
    """On the SDK's stdio logger: of the lines a server wrote to stdout that are not JSON-RPC messages, lets the
    first through as one line (no traceback) and counts the rest on the server (``McpServer.noise_lines``).

    A record is the server's whose private event loop thread logged it (``McpServer`` registers its thread).
    """

    servers: dict[int, McpServer] = {}  # thread ident -> the server whose session runs on that thread

    def filter(self, record: logging.LogRecord) -> bool:
        server = self.servers.get(record.thread)
        if server is None or not str(record.msg).startswith("Failed to parse JSONRPC message"):
            return True
        server.noise_lines += 1
        if server.noise_lines > 1:
            return False
        line = _offending_line(record.exc_info[1] if record.exc_info else None)
        record.msg = (
            "MCP server '%s' wrote a line to stdout that is not a JSON-RPC message: %r (an MCP server must write "
            "only protocol messages to stdout, and its logs to stderr); further such lines are counted, not shown"
        )
        record.args, record.exc_info, record.exc_text = (server.describe(), line), None, None
        return True


def _offending_line(error: BaseException | None) -> str:
    """The line the SDK could not parse, from its pydantic error (cut to 200 characters)."""
    try:
        return str(error.errors()[0]["input"])[:200]
    except (AttributeError, IndexError, KeyError, TypeError):
        return str(error).splitlines()[0][:200] if error is not None and str(error) else "?"


logging.getLogger(_SDK_LOGGER).addFilter(StdoutNoise())


class McpServer:
    """One MCP server process and the client session to it, on a private event loop."""

    def __init__(
        self,
        command: str,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        *,
        startup_timeout: float = 30.0,
    ):
        try:
            from mcp.client.stdio import StdioServerParameters
        except ImportError:
            raise ValueError("mcp tools need the MCP SDK: pip install 'unipg[mcp]'") from None

        self.parameters = StdioServerParameters(
            command=command,
            args=[str(a) for a in args or []],
            env={str(k): str(v) for k, v in (env or {}).items()} or None,
            cwd=cwd,
        )
        self.startup_timeout = startup_timeout
        self.tools: list[Any] = []  # the server's tool descriptions (mcp.types.Tool)
        self.noise_lines = 0  # lines the server wrote to stdout that are not JSON-RPC messages (StdoutNoise)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._session = None
        self._serving: asyncio.Task | None = None
        self._thread = threading.Thread(target=self._run, name="unipg-mcp", daemon=True)
        self._starting = threading.Lock()

    def __reduce__(self):
        """A copy for another process (a Ray environment actor) starts its own server there, on its first call."""
        settings = self.parameters.model_dump(include=set(SERVER_KEYS))
        return _unstarted, (settings, self.startup_timeout)

    def start(self) -> McpServer:
        """Start the server, initialise the session and list the tools; raises ``ValueError`` with the cause."""
        self._thread.start()
        StdoutNoise.servers[self._thread.ident] = self
        failure = None
        if not self._ready.wait(self.startup_timeout):
            failure = f"did not answer within {self.startup_timeout:g} s"
        elif self._failure is not None:
            failure = f"could not be started: {_reason(self._failure)}"
        if failure is not None:
            noise, self.noise_lines = self._noise(), 0  # reported here, not again by close()
            self.close()
            raise ValueError(f"MCP server '{self.describe()}' {failure}{noise}")
        atexit.register(self.close)
        return self

    def _noise(self) -> str:
        """What the server wrote to stdout besides protocol messages, for a message ending in it ("" if nothing)."""
        if not self.noise_lines:
            return ""
        return (
            f"; it wrote {self.noise_lines} lines to stdout that are not JSON-RPC messages (the first is logged above)"
        )

    def _run(self) -> None:
        self._serving = self._loop.create_task(self._serve())
        self._loop.run_until_complete(self._serving)

    async def _serve(self) -> None:
        from mcp import ClientSession
        from mcp.client.stdio import stdio_client

        try:
            async with stdio_client(self.parameters) as (read, write), ClientSession(read, write) as session:
                await session.initialize()
                self.tools = list((await session.list_tools()).tools)
                self._session = session
                self._ready.set()
                await asyncio.Event().wait()  # until close() cancels the task: the SDK then stops the server
        except BaseException as failure:  # noqa: BLE001 — reported by start(), or the cancellation of close()
            self._failure = failure
        finally:
            self._session = None
            self._ready.set()

    async def call(self, name: str, arguments: dict) -> str:
        """Call tool ``name`` on the server from any event loop; its result as text."""
        if not self._thread.is_alive() and self._thread.ident is None:  # a copy that has not started yet
            await asyncio.to_thread(self._start_once)
        if self._session is None:
            raise RuntimeError(f"MCP server '{self.describe()}' is not running")
        future = asyncio.run_coroutine_threadsafe(self._call(name, arguments), self._loop)
        return await asyncio.wrap_future(future)  # cancelling the caller cancels the call on the server's loop

    async def _call(self, name: str, arguments: dict) -> str:
        result = await self._session.call_tool(name, arguments)
        text = result_text(result)
        if _field(result, "is_error", "isError"):
            raise ToolError(text or f"{name} failed")
        return text

    def _start_once(self) -> None:
        with self._starting:
            if self._thread.ident is None:
                self.start()

    def close(self) -> None:
        """End the session and stop the server (and its children); idempotent."""
        atexit.unregister(self.close)
        if self._thread.is_alive():  # a session, or a server still starting: cancelling either stops the process
            self._loop.call_soon_threadsafe(lambda: self._serving.cancel())  # set before the loop runs
            self._thread.join(timeout=15)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()
        if StdoutNoise.servers.pop(self._thread.ident, None) is not None and self.noise_lines > 1:
            _log.warning("MCP server '%s' ended%s", self.describe(), self._noise())

    def describe(self) -> str:
        return " ".join([self.parameters.command, *self.parameters.args])


def _unstarted(settings: dict, startup_timeout: float) -> McpServer:
    return McpServer(**settings, startup_timeout=startup_timeout)


def _field(value: Any, *names: str) -> Any:
    """The first of ``names`` that ``value`` has: the SDK's field names changed case between versions."""
    return next((getattr(value, name) for name in names if getattr(value, name, None) is not None), None)


def _reason(failure: BaseException) -> str:
    inner = getattr(failure, "exceptions", None)  # anyio task groups wrap the cause
    return _reason(inner[0]) if inner else (str(failure) or type(failure).__name__)


def result_text(result: Any) -> str:
    """The text of a ``CallToolResult``: its text parts joined by newlines; structured content as JSON when
    there is no text; other parts (images, resources) named by their type."""
    parts = []
    for item in _field(result, "content") or []:
        text = getattr(item, "text", None)
        parts.append(text if isinstance(text, str) else f"[{getattr(item, 'type', 'content')}]")
    structured = _field(result, "structured_content", "structuredContent")
    if not parts and structured is not None:
        return json.dumps(structured)
    return "\n".join(parts)


def mcp_tool(server: McpServer, description: Any) -> Tool:
    """A unipg tool calling ``description`` (an ``mcp.types.Tool``) on ``server``."""
    name = description.name
    parameters = dict(_field(description, "input_schema", "inputSchema") or {"type": "object", "properties": {}})
    parameters.setdefault("properties", {})

    async def call(**arguments):
        return await server.call(name, arguments)

    call.__name__ = name
    return Tool(
        name,
        description.description or name,
        parameters,
        call,
        required=list(parameters.get("required", [])),
        close=server.close,
    )


@TOOLS.register("mcp")
@names_its_tools(lambda options: options.get("include"))  # without include: whatever the server lists
def mcp_tools(server: dict, include: list[str] | None = None, startup_timeout: float = 30.0) -> list[Tool]:
    """The tools of an MCP server started over stdio.

    ``server``: ``{command: ..., args: [...], env: {...}, cwd: ...}`` (the process to start); ``include``: the
    names of the tools to expose (default: all the server lists); ``startup_timeout``: seconds to wait for the
    server to start and list its tools.
    """
    if not isinstance(server, dict) or not isinstance(server.get("command"), str):
        raise ValueError(
            "an mcp tool needs server: {command: ..., args: [...]}, e.g. "
            "{name: mcp, server: {command: python, args: [my_server.py]}}"
        )
    unknown = sorted(set(server) - set(SERVER_KEYS))
    if unknown:
        raise ValueError(f"mcp server settings are {', '.join(SERVER_KEYS)}; not {', '.join(unknown)}")
    running = McpServer(**server, startup_timeout=startup_timeout).start()
    offered = {description.name: description for description in running.tools}
    missing = sorted(set(include or []) - set(offered))
    if missing:
        running.close()
        raise ValueError(
            f"MCP server '{running.describe()}' has no tool {', '.join(missing)}; it offers "
            f"{', '.join(sorted(offered)) or 'none'}"
        )
    return [mcp_tool(running, offered[name]) for name in (include or offered)]
