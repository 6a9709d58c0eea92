"""The Python sandbox: output capture, and each protection layer tried for real against the child."""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import time

import pytest

from unipg.sample.tools.base import TOOLS
from unipg.sample.tools.sandbox import MAX_FILE_BYTES, run_python, run_python_async


def test_prints_are_captured_and_an_exception_is_reported_with_its_type():
    result = run_python("import sys\nprint('hello', 6 * 7)\nprint('to stderr', file=sys.stderr)\n1 / 0",
                        timeout=2)
    assert result.output == "hello 42\nto stderr\n"
    assert not result.ok and not result.timed_out
    assert result.error == "ZeroDivisionError: division by zero"
    fine = run_python("print('done')", timeout=2)
    assert fine.ok and fine.error is None and fine.output == "done\n"


def test_working_directory_is_fresh_private_and_removed_afterwards(monkeypatch):
    monkeypatch.setenv("UNIPG_SANDBOX_SECRET", "leak")
    result = run_python("import os\nprint(os.getcwd())\nprint(os.listdir('.'))\nprint(sorted(os.environ))",
                        timeout=2)
    workdir, listing, environment = result.output.splitlines()
    assert result.ok and listing == "[]"
    assert "UNIPG_SANDBOX_SECRET" not in environment and "PATH" in environment
    assert not os.path.exists(workdir)


def test_files_can_be_written_inside_the_working_directory_but_not_outside(tmp_path):
    inside = run_python("open('notes.txt', 'w').write('kept')\nprint(open('notes.txt').read())", timeout=2)
    assert inside.ok and inside.output == "kept\n"

    code = f"""
import os
target = {str(tmp_path)!r}
attempts = {{
    "open": lambda: open(os.path.join(target, "open.txt"), "w"),
    "os.open": lambda: os.open(os.path.join(target, "os_open.txt"), os.O_WRONLY | os.O_CREAT),
    "mkdir": lambda: os.mkdir(os.path.join(target, "folder")),
    "symlink": lambda: os.symlink(target, "link"),
    "relative": lambda: open("../../" + target + "/relative.txt", "a"),
}}
for name, attempt in attempts.items():
    try:
        attempt()
        print(name, "allowed")
    except PermissionError:
        print(name, "refused")
"""
    result = run_python(code, timeout=2)
    assert result.ok, result.error
    assert result.output.split() == ["open", "refused", "os.open", "refused", "mkdir", "refused",
                                     "symlink", "refused", "relative", "refused"]
    assert list(tmp_path.iterdir()) == []


def test_network_is_refused_and_no_connection_arrives():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        code = f"""
import socket
for attempt in (lambda: socket.create_connection(("127.0.0.1", {port}), timeout=1),
                lambda: socket.socket().connect(("127.0.0.1", {port}))):
    try:
        attempt()
        print("connected")
    except PermissionError as error:
        print("PermissionError", error)
"""
        result = run_python(code, timeout=2)
        listener.settimeout(0.2)
        with pytest.raises(socket.timeout):
            listener.accept()
    assert result.ok, result.error
    assert "connected" not in result.output
    assert result.output.count("PermissionError") == 2


def test_processes_and_ctypes_cannot_be_used_to_escape(tmp_path):
    marker = str(tmp_path / "escaped")
    code = f"""
import os
marker = {marker!r}
def use_ctypes():
    import ctypes
    ctypes.CDLL(None).system(("touch " + marker).encode())
def raw_fork_exec():
    import _posixsubprocess
    _posixsubprocess.fork_exec()
attempts = {{
    "subprocess": lambda: __import__("subprocess").run(["touch", marker]),
    "system": lambda: os.system("touch " + marker),
    "posix_spawn": lambda: os.posix_spawn("/usr/bin/touch", ["touch", marker], {{}}),
    "fork": os.fork,
    "fork_exec": raw_fork_exec,
    "ctypes": use_ctypes,
}}
for name, attempt in attempts.items():
    try:
        attempt()
        print(name, "allowed")
    except (PermissionError, ImportError) as error:
        print(name, type(error).__name__)
"""
    result = run_python(code, timeout=2)
    assert result.ok, result.error
    assert result.output.split() == ["subprocess", "PermissionError", "system", "PermissionError",
                                     "posix_spawn", "PermissionError", "fork", "PermissionError",
                                     "fork_exec", "PermissionError", "ctypes", "ImportError"]
    assert not os.path.exists(marker)


def test_an_infinite_loop_is_killed_at_the_timeout():
    start = time.monotonic()
    result = run_python("print('started', flush=True)\nwhile True:\n    pass", timeout=1)
    elapsed = time.monotonic() - start
    assert result.timed_out and not result.ok
    assert result.error == "timed out after 1.0 s"
    assert result.output == "started\n"  # what was printed before the kill is kept
    assert 1.0 <= elapsed < 3.0


def test_allocating_past_the_memory_limit_is_a_memory_error_in_the_child_only():
    result = run_python("data = bytearray(1 << 30)\nprint('allocated')", timeout=2, memory_mb=128)
    assert not result.ok and not result.timed_out
    assert result.error == "MemoryError" and "allocated" not in result.output
    assert len(bytearray(1 << 20)) == 1 << 20  # the parent is unaffected


def test_resource_limits_are_set_and_cannot_be_raised():
    code = """
import resource as r
for limit in (r.RLIMIT_AS, r.RLIMIT_CPU, r.RLIMIT_FSIZE, r.RLIMIT_CORE):
    print(*r.getrlimit(limit))
try:
    open("big.bin", "wb").write(bytes(11 << 20))
except OSError as error:
    print("write failed", error.errno)
r.setrlimit(r.RLIMIT_AS, (r.RLIM_INFINITY, r.RLIM_INFINITY))
"""
    result = run_python(code, timeout=1.5, memory_mb=200)
    lines = result.output.splitlines()
    assert lines[:4] == [f"{200 << 20} {200 << 20}", "3 3", f"{MAX_FILE_BYTES} {MAX_FILE_BYTES}", "0 0"]
    assert lines[4] == "write failed 27"  # EFBIG: RLIMIT_FSIZE caps files at 10 MB
    assert result.error.startswith("PermissionError") and "resource.setrlimit" in result.error
    assert resource.getrlimit(resource.RLIMIT_CORE) is not None  # the parent's limits are its own


def test_long_output_is_truncated_with_a_marker_saying_how_much_was_cut():
    result = run_python("print('x' * 5000, end='')", timeout=2, max_output_chars=100)
    assert result.ok
    shown, marker = result.output.split("\n")
    assert shown == "x" * 100
    assert marker == "[... output truncated: 4900 more characters not shown]"
    flood = run_python("for _ in range(20000):\n    print('y' * 99)", timeout=2, max_output_chars=50)
    assert flood.ok and "1999950 more characters" in flood.output  # counted past the kept head too


def test_sandboxes_run_concurrently_on_one_event_loop():
    async def three_at_once():
        code = "import time\ntime.sleep(0.6)\nprint('slept')"
        return await asyncio.gather(*(run_python_async(code, timeout=3) for _ in range(3)))

    start = time.monotonic()
    results = asyncio.run(three_at_once())
    assert [result.output for result in results] == ["slept\n"] * 3
    assert time.monotonic() - start < 1.7  # 3 × 0.6 s one after the other would take 1.8 s


def _child_pids() -> set[int]:
    """Processes whose parent is this test process (from /proc/<pid>/stat: "pid (comm) state ppid ...")."""
    children = set()
    for stat in os.listdir("/proc"):
        try:
            with open(f"/proc/{stat}/stat") as file:
                fields = file.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # not a process, or it ended while we looked
        if int(fields[1]) == os.getpid():
            children.add(int(stat))
    return children


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc to list child processes")
def test_cancelling_a_run_kills_its_interpreter():
    before = _child_pids()  # e.g. a helper service an earlier test left running

    async def cancel_midway():
        task = asyncio.ensure_future(run_python_async("import time\ntime.sleep(30)", timeout=30))
        await asyncio.sleep(0.5)
        running = _child_pids() - before
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return running

    running = asyncio.run(cancel_midway())
    assert len(running) == 1  # the sandbox interpreter, while the task ran
    assert not running & _child_pids()


def test_python_tool_has_a_code_parameter_and_returns_strings():
    python = TOOLS.get("python")(timeout=2, max_output_chars=500)
    schema = python.schema()["function"]
    assert schema["name"] == "python" and python.is_async
    assert list(schema["parameters"]["properties"]) == ["code"] and schema["parameters"]["required"] == ["code"]
    assert schema["parameters"]["properties"]["code"]["type"] == "string"
    assert "print" in schema["description"]

    async def calls():
        return (await python.function(code="print(2 ** 10)"),
                await python.function(code="print('partial', end='')\nraise ValueError('bad input')"),
                await python.function(code="x = 1"))

    success, failure, silent = asyncio.run(calls())
    assert success == "1024\n"
    assert failure == "partial\nValueError: bad input"
    assert silent.startswith("(no output")


def test_limits_the_sandbox_cannot_honour_are_rejected():
    with pytest.raises(ValueError, match="timeout"):
        TOOLS.get("python")(timeout=0)
    with pytest.raises(ValueError, match="memory_mb"):
        run_python("print(1)", memory_mb=8)
