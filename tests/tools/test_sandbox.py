"""The Python sandbox: output capture, and each protection layer tried for real against the child."""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import subprocess
import time

import pytest

from tests.helpers.processes import processes_mentioning
from unipg.tools.base import TOOLS
from unipg.tools.sandbox import MAX_FILE_BYTES, run_python, run_python_async


def test_prints_are_captured_and_an_exception_is_reported_with_its_type():
    result = run_python("import sys\nprint('hello', 6 * 7)\nprint('to stderr', file=sys.stderr)\n1 / 0", timeout=2)
    assert result.output == "hello 42\nto stderr\n"
    assert not result.ok and not result.timed_out
    assert result.error == "ZeroDivisionError: division by zero"
    fine = run_python("print('done')", timeout=2)
    assert fine.ok and fine.error is None and fine.output == "done\n"


def test_working_directory_is_fresh_private_and_removed_afterwards():
    result = run_python("import os\nprint(os.getcwd())\nprint(os.listdir('.'))", timeout=2)
    workdir, listing = result.output.splitlines()
    assert result.ok and listing == "[]"
    assert not os.path.exists(workdir)


def test_the_trainers_environment_variables_cannot_be_seen_from_inside(monkeypatch):
    secrets = {
        "WANDB_API_KEY": "wandb-sentinel-7f3a",
        "OPENAI_API_KEY": "openai-sentinel-9c1e",
        "UNIPG_SANDBOX_SECRET": "unipg-sentinel-2b4d",
    }
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    code = """
import os
print(sorted(os.environ))
print(open("/proc/self/environ", "rb").read().replace(b"\\0", b" ").decode())
try:
    print(open(f"/proc/{os.getppid()}/environ", "rb").read())
except PermissionError as error:
    print("parent environ:", error)
"""
    result = run_python(code, timeout=2)
    names, own_environ, parent_environ = result.output.splitlines()
    assert result.ok, result.error
    assert "PATH" in names and "HOME" in names and "PATH=/usr/bin:/bin" in own_environ
    # refused by the sandbox's own rule, not only by the kernel when a user namespace happens to exist
    assert parent_environ.startswith("parent environ: reading /proc/")
    for name, value in secrets.items():
        assert name not in result.output and value not in result.output


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
    assert result.output.split() == [
        "open",
        "refused",
        "os.open",
        "refused",
        "mkdir",
        "refused",
        "symlink",
        "refused",
        "relative",
        "refused",
    ]
    assert list(tmp_path.iterdir()) == []


def test_reading_outside_the_working_directory_and_the_libraries_is_refused(tmp_path):
    checkpoint = tmp_path / "checkpoint.pt"  # stands for the trainer's run folder
    checkpoint.write_text("run-folder-secret")
    code = f"""
import os, pathlib
checkpoint = {str(checkpoint)!r}
# a relative link made one folder down points inside; moved up a level, it points at the checkpoint
os.mkdir("down")
os.symlink("../" + os.path.relpath(checkpoint, os.path.dirname(os.getcwd())), "down/link")
os.rename("down/link", "link")
attempts = {{
    "passwd": lambda: open("/etc/passwd").read(),
    "checkpoint": lambda: open(checkpoint, "rb").read(),
    "os.open": lambda: os.read(os.open(checkpoint, os.O_RDONLY), 100),
    "pathlib": lambda: pathlib.Path(checkpoint).read_text(),
    "listdir": lambda: os.listdir(os.path.dirname(checkpoint)),
    "scandir": lambda: list(os.scandir("/")),
    "parent-proc": lambda: open(f"/proc/{{os.getppid()}}/cmdline", "rb").read(),
    "proc-root": lambda: open("/proc/self/root/etc/passwd").read(),
    "link-read": lambda: open("link").read(),
    "link-write": lambda: open("link", "w").write("overwritten"),
}}
for name, attempt in attempts.items():
    try:
        print(name, "allowed", attempt())
    except PermissionError as error:
        print(name, "refused" if "not allowed in the sandbox" in str(error) else error)
"""
    result = run_python(code, timeout=2)
    assert result.ok, result.error
    assert [line.split()[1] for line in result.output.splitlines()] == ["refused"] * 10, result.output
    assert "run-folder-secret" not in result.output and checkpoint.read_text() == "run-folder-secret"


def test_the_standard_library_numpy_time_zones_and_own_files_can_still_be_read():
    code = """
import numpy, json, decimal, fractions, datetime, statistics, math, re, collections, zoneinfo, os
print(datetime.datetime.now().year >= 2024, zoneinfo.ZoneInfo("Europe/Paris"))
print(numpy.linalg.inv(2 * numpy.eye(2)).sum(), statistics.mean([1, 2, 6]), fractions.Fraction(2, 6))
print(len(open(json.__file__).read()) > 0, open("/proc/self/status").readline().split()[0])
open("notes.txt", "w").write("mine")
print(open("notes.txt").read(), os.listdir("."), len(os.urandom(4)))
"""
    result = run_python(code, timeout=5)
    assert result.ok, result.output + str(result.error)
    assert result.output.splitlines() == ["True Europe/Paris", "1.0 3 1/3", "True Name:", "mine ['notes.txt'] 4"]


def test_network_is_refused_and_nothing_arrives_over_tcp_udp_or_unix_sockets(tmp_path):
    unix_path = str(tmp_path / "trainer.sock")
    with socket.socket() as tcp, socket.socket(type=socket.SOCK_DGRAM) as udp, socket.socket(socket.AF_UNIX) as unix:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen(1)
        udp.bind(("127.0.0.1", 0))
        unix.bind(unix_path)
        unix.listen(1)
        code = f"""
import socket
attempts = {{
    "tcp": lambda: socket.create_connection(("127.0.0.1", {tcp.getsockname()[1]}), timeout=1),
    "tcp-raw": lambda: socket.socket().connect(("127.0.0.1", {tcp.getsockname()[1]})),
    "udp": lambda: socket.socket(type=socket.SOCK_DGRAM).sendto(b"hello", ("127.0.0.1", {udp.getsockname()[1]})),
    "unix": lambda: socket.socket(socket.AF_UNIX).connect({unix_path!r}),
    "socketpair": socket.socketpair,
    "dns": lambda: socket.getaddrinfo("localhost", 80),
}}
for name, attempt in attempts.items():
    try:
        attempt()
        print(name, "allowed")
    except PermissionError:
        print(name, "refused")
"""
        result = run_python(code, timeout=2)
        for listener in (tcp, udp, unix):
            listener.settimeout(0.1)
        with pytest.raises(socket.timeout):
            tcp.accept()
        with pytest.raises(socket.timeout):
            udp.recv(16)
        with pytest.raises(socket.timeout):
            unix.accept()
    assert result.ok, result.error
    assert result.output.split() == [
        "tcp",
        "refused",
        "tcp-raw",
        "refused",
        "udp",
        "refused",
        "unix",
        "refused",
        "socketpair",
        "refused",
        "dns",
        "refused",
    ]


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
    "forkpty": lambda: __import__("pty").fork(),
    "fork_exec": raw_fork_exec,
    "multiprocessing": lambda: __import__("multiprocessing").Process(target=print).start(),
    "process_pool": lambda: __import__("concurrent.futures").futures.ProcessPoolExecutor(2).submit(print).result(),
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
    assert result.output.split() == [
        "subprocess",
        "PermissionError",
        "system",
        "PermissionError",
        "posix_spawn",
        "PermissionError",
        "fork",
        "PermissionError",
        "forkpty",
        "PermissionError",
        "fork_exec",
        "PermissionError",
        "multiprocessing",
        "PermissionError",
        "process_pool",
        "PermissionError",
        "ctypes",
        "ImportError",
    ]
    assert not os.path.exists(marker)


def test_a_fork_bomb_stops_at_its_first_fork():
    before = _child_pids()
    result = run_python("import os\nwhile True:\n    os.fork()", timeout=3)
    assert result.error == "PermissionError: starting processes is not allowed in the sandbox (os.fork)"
    assert result.seconds < 2.5 and not result.timed_out
    assert _child_pids() <= before


def test_calls_that_reach_outside_without_an_audit_event_are_removed_or_refused(tmp_path):
    victim = subprocess.Popen(["sleep", "30"])  # stands for the trainer: same user, so signals would reach it
    try:
        code = f"""
import os, signal, sys
target = {str(tmp_path)!r}
def reimport_posix():
    del sys.modules["posix"]
    import posix
def attach_database():
    import sqlite3
    sqlite3.connect(":memory:").execute(f"ATTACH '{{target}}/attached.db' AS outside")
def tcl():
    import tkinter
    tkinter.Tcl().eval("exec touch " + target + "/tcl")
def subinterpreter():
    import _xxsubinterpreters as interpreters
    interpreters.run_string(interpreters.create(), "open('/etc/passwd').read()")
def history():
    import readline
    readline.read_history_file("/etc/passwd")
attempts = {{
    "pidfd": lambda: signal.pidfd_send_signal(os.pidfd_open({victim.pid}), signal.SIGKILL),
    "mknod": lambda: os.mknod(target + "/node"),
    "mkfifo": lambda: os.mkfifo(target + "/fifo"),
    "renice": lambda: os.setpriority(os.PRIO_PROCESS, {victim.pid}, 19),
    "posix": reimport_posix,
    "sqlite": attach_database,
    "tcl": tcl,
    "subinterpreter": subinterpreter,
    "readline": history,
    "shared_memory": lambda: __import__("multiprocessing.shared_memory").shared_memory.SharedMemory(create=True,
                                                                                                  size=64),
    "users": lambda: __import__("pwd").getpwall(),
}}
for name, attempt in attempts.items():
    try:
        attempt()
        print(name, "allowed")
    except (PermissionError, ImportError, AttributeError) as error:
        print(name, "refused" if "sandbox" in str(error) or "has no attribute" in str(error) else error)
"""
        result = run_python(code, timeout=3)
        assert victim.poll() is None  # still running
        assert os.getpriority(os.PRIO_PROCESS, victim.pid) == os.getpriority(os.PRIO_PROCESS, 0)
    finally:
        victim.kill()
        victim.wait()
    assert result.ok, result.error
    assert [line.split(maxsplit=1)[1] for line in result.output.splitlines()] == ["refused"] * 11, result.output
    assert list(tmp_path.iterdir()) == []


def test_an_infinite_loop_is_killed_at_the_timeout_and_leaves_no_process_behind():
    psutil = pytest.importorskip("psutil")
    start = time.monotonic()
    code = (
        "import os\nprint('started', os.getpid(), os.getpgid(0), os.getsid(0), os.getcwd(), flush=True)\n"
        "while True:\n    pass"
    )
    result = run_python(code, timeout=1)
    elapsed = time.monotonic() - start
    assert result.timed_out and not result.ok
    assert result.error == "timed out after 1.0 s"
    started, pid, group, session, workdir = result.output.split()  # what was printed before the kill is kept
    assert started == "started" and pid == group == session  # its own session, so killing the group is enough
    assert 1.0 <= elapsed < 30.0  # killed, not left to loop (the bound is loose: a busy machine starts it slowly)
    if pid == "1":  # the init of its own PID namespace: its pids mean nothing here, its command line does
        assert processes_mentioning(workdir) == []
        return
    assert not psutil.pid_exists(int(pid))
    remaining = []
    for process in psutil.process_iter():
        try:
            if int(group) in (os.getpgid(process.pid), os.getsid(process.pid)):
                remaining.append(process)
        except (ProcessLookupError, PermissionError):
            continue  # it ended while we looked
    assert remaining == []


def test_allocating_past_the_memory_limit_is_a_memory_error_in_the_child_only():
    result = run_python("data = bytearray(1 << 30)\nprint('allocated')", timeout=2, memory_mb=128)
    assert not result.ok and not result.timed_out
    assert result.error == "MemoryError" and "allocated" not in result.output
    growing = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))", timeout=3, memory_mb=128)
    assert growing.error == "MemoryError" and not growing.timed_out
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
    code = "import time\ntime.sleep(0.6)\nprint('slept')"

    async def timed():
        start = time.monotonic()
        result = await run_python_async(code, timeout=30)
        return result, start, time.monotonic()

    async def three_at_once():
        return await asyncio.gather(*(timed() for _ in range(3)))

    results = asyncio.run(three_at_once())
    assert [result.output for result, _, _ in results] == ["slept\n"] * 3
    assert max(start for _, start, _ in results) < min(end for _, _, end in results)  # all three ran at once


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
        running = set()
        for _ in range(6000):  # until the interpreter has started (at most a minute)
            running = _child_pids() - before
            if running:
                break
            await asyncio.sleep(0.01)
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
        return (
            await python.function(code="print(2 ** 10)"),
            await python.function(code="print('partial', end='')\nraise ValueError('bad input')"),
            await python.function(code="x = 1"),
        )

    success, failure, silent = asyncio.run(calls())
    assert success == "1024\n"
    assert failure == "partial\nValueError: bad input"
    assert silent.startswith("(no output")


def test_limits_the_sandbox_cannot_honour_are_rejected():
    with pytest.raises(ValueError, match="timeout"):
        TOOLS.get("python")(timeout=0)
    with pytest.raises(ValueError, match="memory_mb"):
        run_python("print(1)", memory_mb=8)
    with pytest.raises(ValueError, match="disk_mb"):
        run_python("print(1)", disk_mb=0)
