"""The test MCP server (``tests/tools/mcp_server.py``, written with the MCP SDK): its tool spec and the pids it
writes."""

import sys
from pathlib import Path

SERVER = Path(__file__).parents[1] / "tools" / "mcp_server.py"


def server_spec(pid_file: Path | None = None, **options) -> dict:
    """The ``task.tools`` entry of the server; with ``pid_file``, each server started appends its pid there."""
    args = [str(SERVER)] + ([str(pid_file)] if pid_file else [])
    spec = {"name": "mcp", "server": {"command": sys.executable, "args": args}}
    return {**spec, "options": options} if options else spec


def server_pids(pid_file: Path) -> list[int]:
    return [int(line) for line in pid_file.read_text().split()]
