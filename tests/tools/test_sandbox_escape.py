"""Escapes from the Python sandbox that only the kernel boundary (bubblewrap) stops."""

from __future__ import annotations

import os
import socket
import time

import pytest

import unipg
from tests.helpers.processes import processes_mentioning
from unipg.tools.base import TOOLS
from unipg.tools.bubblewrap import MISSING, bwrap_command, kernel_isolation_available
from unipg.tools.sandbox import run_python

needs_bwrap = pytest.mark.skipif(
    not kernel_isolation_available(), reason="needs bubblewrap (apt-get install bubblewrap) able to create namespaces"
)

# switches the audit hook off through the object graph: every cell of its closure becomes harmless
DISABLE_HOOK = """
import gc
def _nothing(*args, **kwargs):
    return None
harmless = {"check_open": _nothing, "refuse_read": _nothing, "refuse_write": _nothing, "resolve": _nothing,
            "refused_prefixes": (), "blocked_imports": set(), "blocked_prefixes": (), "path_events": {},
            "read_events": ()}
for hook in [o for o in gc.get_objects() if type(o).__name__ == "function" and o.__name__ == "hook"]:
    for name, cell in zip(hook.__code__.co_freevars, hook.__closure__ or ()):
        if name in harmless:
            cell.cell_contents = harmless[name]
"""


def attempt(code: str, isolation: str = "kernel", timeout: float = 10) -> str:
    """Run ``code`` and return its output; the code prints one line per attempt."""
    result = run_python(code, timeout=timeout, isolation=isolation)
    return result.output + (result.error or "")


@needs_bwrap
def test_dir_fd_traversal_cannot_read_or_write_outside(tmp_path):
    target = tmp_path / "outside.txt"
    # the descriptor is on the working directory, the cwd far below it: the audit hook resolves the path
    # against the cwd (inside), the kernel against the descriptor (outside)
    code = f"""
import os
fd = os.open(".", os.O_RDONLY)
deep = "/".join("d" * 40)
os.makedirs(deep)
os.chdir(deep)
up = "../" * 32
try:
    print("read", os.read(os.open(up + "etc/passwd", os.O_RDONLY, dir_fd=fd), 100))
except OSError as error:
    print("read refused", type(error).__name__)
if {{isolation!r}} == "kernel":
    try:
        os.write(os.open(up + {str(target)[1:]!r}, os.O_WRONLY | os.O_CREAT, dir_fd=fd), b"escaped")
        print("wrote")
    except OSError as error:
        print("write refused", type(error).__name__)
"""
    assert "read b'root:" in attempt(code.format(isolation="process"), isolation="process")  # the weak boundary
    output = attempt(code.format(isolation="kernel"))
    assert "read refused" in output and "write refused" in output, output
    assert "root:" not in output and not target.exists()


@needs_bwrap
def test_disabling_the_audit_hook_opens_nothing(tmp_path):
    probe = DISABLE_HOOK + "print('passwd', open('/etc/passwd').read()[:5])\n"
    assert "passwd root:" in attempt(probe, isolation="process")  # the escape works on the weak boundary
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    code = (
        DISABLE_HOOK
        + f"""
import os, socket, subprocess
for name, action in [("passwd", lambda: open("/etc/passwd").read()),
                     ("shell", lambda: subprocess.run(["/bin/sh", "-c", "cat /etc/passwd"], check=True)),
                     ("os.system", lambda: os.system("cat /etc/passwd") or "ran"),
                     ("socket", lambda: socket.create_connection(("127.0.0.1", {listener.getsockname()[1]}), 2)),
                     ("dns", lambda: socket.getaddrinfo("example.com", 80))]:
    try:
        print(name, "escaped", action())
    except Exception as error:
        print(name, "refused", type(error).__name__)
"""
    )
    try:
        output = attempt(code)
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
    for name in ("passwd", "shell", "socket", "dns"):
        assert f"{name} refused" in output, output
    assert "root:" not in output and "os.system escaped ran" not in output


@needs_bwrap
@pytest.mark.parametrize("parent_loops", [False, True])
def test_a_forked_and_detached_grandchild_dies_with_the_call(parent_loops):
    code = (
        DISABLE_HOOK
        + f"""
import os, time
print(os.getcwd(), flush=True)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        for fd in range(3, 10):
            try:
                os.close(fd)
            except OSError:
                pass
        os.close(0); os.close(1); os.close(2)
        time.sleep(600)
    os._exit(0)
while {parent_loops}:
    pass
"""
    )
    start = time.monotonic()
    result = run_python(code, timeout=3)
    workdir = result.output.split()[0]
    assert result.timed_out == parent_loops and time.monotonic() - start < 60
    # the kernel ends every process of the namespace before bubblewrap exits, so this holds at once
    assert processes_mentioning(workdir) == []


@needs_bwrap
def test_host_processes_the_package_and_system_files_are_out_of_reach():
    package = os.path.dirname(unipg.__file__)
    code = (
        DISABLE_HOOK
        + f"""
import os
for name, action in [("trainer environ", lambda: open("/proc/{os.getpid()}/environ").read()),
                     ("init environ", lambda: "PYTHONPATH" in open("/proc/1/environ").read() or None),
                     ("package", lambda: open({package!r} + "/planted.py", "w").write("x")),
                     ("etc", lambda: os.listdir("/etc"))]:
    try:
        result = action()
        print(name, "refused" if result is None or result is False else "escaped", flush=True)
    except Exception as error:
        print(name, "refused", type(error).__name__, flush=True)
print("uid", os.getuid(), "pid", os.getpid())
"""
    )
    output = attempt(code)
    for name in ("trainer environ", "init environ", "package", "etc"):
        assert f"{name} refused" in output, output
    assert not os.path.exists(os.path.join(package, "planted.py"))
    assert "pid 1" in output  # its own PID namespace


def test_kernel_isolation_without_bubblewrap_fails_when_the_tool_is_built(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    kernel_isolation_available.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="apt-get install bubblewrap"):
            TOOLS.get("python")(timeout=2, isolation="kernel")  # the default, named: conftest may change it
        assert "isolation: process" in MISSING
        assert TOOLS.get("python")(timeout=2, isolation="process") is not None
        with pytest.raises(ValueError, match="isolation"):
            TOOLS.get("python")(isolation="container")
    finally:
        kernel_isolation_available.cache_clear()


def test_the_fresh_tmp_is_mounted_before_the_interpreter_so_a_venv_under_tmp_stays_visible():
    command = bwrap_command("/tmp/work", {}, disk_bytes=3 << 20)
    first_bind = command.index("--ro-bind")
    tmp = command.index("/tmp")
    assert tmp < first_bind and command[tmp - 3 : tmp] == ["--size", str(3 << 20), "--tmpfs"]
    assert "--bind" not in command and command.index("--dir") > first_bind  # the working directory, on that /tmp
    with pytest.raises(ValueError, match="/tmp"):
        bwrap_command("/var/work", {}, disk_bytes=1 << 20)


@needs_bwrap
def test_everything_the_code_writes_anywhere_is_bounded_by_disk_mb():
    # with the audit hook off, only the kernel bounds it: 1 MB files (under RLIMIT_FSIZE) until 8 MB or an error
    code = (
        DISABLE_HOOK
        + """
import os
for place in (".", "/tmp", "/dev/shm", "/", "/dev", "/usr"):
    written = 0
    try:
        for index in range(8):
            with open(os.path.join(place, f"{os.path.basename(place) or 'root'}-{index}"), "wb") as file:
                file.write(bytes(1 << 20))
            written += 1
        print(place, "wrote", written, "MB")
    except OSError as error:
        print(place, "stopped after", written, "MB:", error.strerror)
"""
    )
    result = run_python(code, timeout=20, disk_mb=4)
    lines = result.output.splitlines()
    assert result.ok, result.output + str(result.error)
    stopped = [(line.split()[0], int(line.split()[3]), line.split(":")[1].strip()) for line in lines]
    # the working directory and /tmp share one 4 MB tmpfs: the first fills it, the second finds it full;
    # /dev/shm holds 1 MB; the root, /dev, and folders made for mount points are read-only
    assert stopped == [
        (".", 4, "No space left on device"),
        ("/tmp", 0, "No space left on device"),
        ("/dev/shm", 1, "No space left on device"),
        ("/", 0, "Read-only file system"),
        ("/dev", 0, "Read-only file system"),
        ("/usr", 0, "Read-only file system"),
    ], lines
    # unhandled, the failed write is the run's clear error, not a timeout
    full = run_python("open('big.bin', 'wb').write(bytes(8 << 20))", timeout=20, disk_mb=4)
    assert not full.ok and not full.timed_out
    assert full.error == "OSError: [Errno 28] No space left on device"
