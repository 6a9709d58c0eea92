"""A Python sandbox tool: run a model's code in a fresh, limited interpreter and return what it prints.

Every call starts ``sys.executable -I -B`` (isolated mode: no user site, no ``PYTHON*`` variables, no
bytecode written) in a new session, with a stripped environment and a fresh temporary working directory
that is deleted afterwards. The code travels over stdin, never through a shell. Protection comes in layers:

1. **Kernel isolation** (``isolation="kernel"``, the default; ``unipg.tools.bubblewrap``). The child
   runs under ``bwrap`` in new user, mount, PID, network, IPC, UTS and cgroup namespaces, with no
   capabilities, ``--die-with-parent`` and ``--new-session`` (no terminal to inject input into). Its root file
   system is read-only and holds: the interpreter, its standard library and site-packages, ``/usr/lib`` and
   ``/lib``; a private ``/proc`` showing only its own namespace; a minimal read-only ``/dev`` with a 1 MB
   ``/dev/shm`` for semaphores; and a private ``/tmp``, a tmpfs of ``disk_mb`` holding the working directory,
   the only other writable place. There is no ``/etc``, home folder, run
   folder, repository or ``/usr/bin``, so no shell or other program to run, and only a downed loopback. The
   child is the PID namespace's init: when it ends or is killed, the kernel kills every process it started,
   detached with ``setsid`` or not. This layer is the security boundary, enforced by the kernel whatever the
   code does inside the interpreter. Building the tool raises ``RuntimeError`` with the remedy when ``bwrap``
   is missing or cannot create namespaces (checked once per process); ``isolation="process"`` runs the layers
   below alone.
2. **Wall clock.** After ``timeout`` seconds the namespace's init, then the whole process group, is killed
   with SIGKILL.
3. **Resource limits** (``setrlimit`` in the child, soft = hard, so the code cannot raise them back):
   ``RLIMIT_AS`` (``memory_mb``; exceeding it raises ``MemoryError`` in the child, the parent is unaffected),
   ``RLIMIT_CPU`` (a backstop, slightly above ``timeout``), ``RLIMIT_FSIZE`` (10 MB per file) and
   ``RLIMIT_CORE`` 0. ``RLIMIT_NPROC`` is not set: it counts every process of the user, trainer included.
4. **An audit hook** (PEP 578), installed before the code runs, refuses with ``PermissionError``: sockets
   and name lookups; starting processes (``subprocess``, ``multiprocessing``, ``os.system``, ``os.exec*``,
   ``os.posix_spawn``, ``os.fork``), new interpreters, and signalling processes (``os.kill``); every
   ``ctypes`` event; ``sqlite3`` connections; raising resource limits; creating, writing, renaming, removing
   or chmod-ing any path that resolves outside the working directory; and reading or listing any path outside
   the working directory, the interpreter's libraries, the time-zone database and a few devices. Importing
   modules that reach outside with no audit event is an ``ImportError``; ``os.mknod``, ``os.mkfifo``,
   ``os.pidfd_open`` and similar calls are deleted. The environment is rebuilt from scratch. Under kernel
   isolation this layer exists for clear error messages; with ``isolation="process"`` it is all there is
   (with a best-effort private network namespace), and it is not a security boundary: it runs inside the
   process it guards, so introspection can reach its closure and switch it off, a ``dir_fd`` path is resolved
   against the working directory while the kernel resolves it against the descriptor, and a forked process
   in a new session outlives the group kill.

What holds under kernel isolation: no file outside the working directory can be written; nothing but the
read-only paths above can be read (not ``/etc/passwd``, not the trainer's ``/proc/<pid>/environ``, not its
run folder); no network; no process survives the call; CPU time, memory and file size are bounded by the
rlimits and the wall clock; everything written, all files together, is bounded by ``disk_mb`` (+ 1 MB in
``/dev/shm``; the tmpfs holds it in memory pages, which ``memory_mb`` does not count; past it a write fails with ``OSError: [Errno 28]
No space left on device``). What does not: the code can read everything bound read-only (the standard
library, every package in the environment's site-packages, and ``/usr/lib``), and learn the kernel version,
CPU count and load; once it switches the audit hook off it can fork more interpreters (inside the same
namespaces, dying with it) and use ``ctypes``; timing side channels on shared CPUs and caches remain; the
kernel itself is the attack surface (no seccomp filter is installed); kernel objects that hold memory
outside any file system (``memfd_create`` files, System V shared memory in the private IPC namespace, pipe
buffers) are bounded only per object (``RLIMIT_FSIZE``, ``memory_mb`` while mapped) and in time (they go with
the namespace at the end of the call), not in total; with ``isolation="process"`` the working directory is a
host folder whose total size is not bounded. ``bwrap`` needs unprivileged user
namespaces enabled (``kernel.unprivileged_userns_clone``, AppArmor's ``restrict_unprivileged_userns`` on
recent Ubuntu) or root; a container that forbids them (Docker's default seccomp profile) needs
``isolation="process"`` or a different outer sandbox such as gVisor.

``run_python_async`` is the implementation (asyncio subprocesses, so many episodes can run sandboxes at
once without threads); ``run_python`` is its synchronous wrapper. The tool is registered as ``"python"``.
The code that runs inside the child, applying layers 3 and 4, is in ``unipg.tools.sandbox_child``.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

from unipg.tools import sandbox_child
from unipg.tools.base import TOOLS, Tool, tool
from unipg.tools.bubblewrap import bwrap_command, require_kernel_isolation, sandbox_workdir

MAX_FILE_BYTES = 10 << 20  # RLIMIT_FSIZE: the largest file the code may write
ISOLATIONS = ("kernel", "process")  # bubblewrap namespaces around the layers below, or the layers alone
MIN_MEMORY_MB = 64  # below this a bare interpreter cannot start under RLIMIT_AS
_READ_CHUNK = 1 << 16


@dataclass
class SandboxResult:
    """What one sandboxed run produced."""

    output: str  # stdout and stderr interleaved, truncated to max_output_chars with a marker
    ok: bool  # the code ran to its end (or exited with status 0) without an exception
    timed_out: bool  # killed at the wall-clock limit
    error: str | None  # "ZeroDivisionError: division by zero", "MemoryError", "timed out after 5.0 s", ...
    seconds: float  # wall-clock time of the whole run, interpreter start included


class SandboxError(RuntimeError):
    """The sandbox itself could not start (not an error of the code it was given)."""


def run_python(
    code: str,
    *,
    timeout: float = 5.0,
    memory_mb: int = 256,
    max_output_chars: int = 2000,
    disk_mb: int = 64,
    isolation: str = "kernel",
) -> SandboxResult:
    """Run ``code`` in a fresh sandboxed interpreter; synchronous wrapper of ``run_python_async``.

    Uses ``asyncio.run``, so call it from plain code; inside an event loop ``await run_python_async``.
    """
    limits = {"timeout": timeout, "memory_mb": memory_mb, "max_output_chars": max_output_chars, "disk_mb": disk_mb}
    return asyncio.run(run_python_async(code, **limits, isolation=isolation))


async def run_python_async(
    code: str,
    *,
    timeout: float = 5.0,
    memory_mb: int = 256,
    max_output_chars: int = 2000,
    disk_mb: int = 64,
    isolation: str = "kernel",
) -> SandboxResult:
    """Run ``code`` in a fresh sandboxed interpreter (see the module docstring for the layers).

    Errors of the code (exceptions, limits, timeouts) are reported in the result; ``SandboxError`` is
    raised only when the interpreter could not be started or set up. ``isolation="kernel"`` (the default)
    runs the child under bubblewrap and raises ``RuntimeError`` when bubblewrap cannot be used here.
    """
    check_limits(timeout=timeout, memory_mb=memory_mb, max_output_chars=max_output_chars, disk_mb=disk_mb)
    check_isolation(isolation)
    start = time.monotonic()
    # ignore_cleanup_errors: the code may leave read-only files behind; TemporaryDirectory still
    # resets permissions and removes them, and a failure there must not hide the result
    with tempfile.TemporaryDirectory(prefix="unipg-sandbox-", ignore_cleanup_errors=True) as workdir:
        report_read, report_write = os.pipe()  # a private channel for "ready" and the exception line
        # bubblewrap writes the host pid of the namespace's init (the child) here
        info_read, info_write = os.pipe() if isolation == "kernel" else (-1, -1)
        try:
            config = {
                "workdir": os.path.realpath(workdir) if isolation == "process" else sandbox_workdir(workdir),
                "report_fd": report_write,
                "memory_bytes": memory_mb << 20,
                "cpu_seconds": math.ceil(timeout) + 1,
                "file_bytes": MAX_FILE_BYTES,
            }
            process = await _spawn(config, info_write, disk_mb << 20)
            for fd in (report_write, info_write):
                if fd >= 0:
                    os.close(fd)
            report_write = info_write = -1
            # UTF-8 takes at most 4 bytes a character, so this head always holds max_output_chars + 1
            capture = _Capture(limit=4 * max_output_chars + 4)
            timed_out = await _wait_with_timeout(process, code.encode("utf-8", "replace"), capture, timeout, info_read)
            report = _read_available(report_read)
        finally:
            for fd in (report_read, report_write, info_read, info_write):
                if fd >= 0:
                    os.close(fd)
    output = _truncate(capture.head.decode("utf-8", "replace"), capture.dropped, max_output_chars)
    if not report.startswith("ready\n") and not timed_out:
        raise SandboxError(
            f"the sandbox interpreter failed before running the code "
            f"(exit status {process.returncode}): {output[-1000:]}"
        )
    error = _error_of(process.returncode, report.removeprefix("ready\n").strip(), timed_out, timeout)
    return SandboxResult(output, error is None, timed_out, error, time.monotonic() - start)


def check_limits(*, timeout: float, memory_mb: int, max_output_chars: int, disk_mb: int) -> None:
    """Reject limits the sandbox cannot honour, with the reason."""
    if not timeout > 0:
        raise ValueError(f"sandbox timeout must be > 0 seconds, got {timeout}")
    if memory_mb < MIN_MEMORY_MB:
        raise ValueError(
            f"sandbox memory_mb must be >= {MIN_MEMORY_MB} (the interpreter itself needs it), got {memory_mb}"
        )
    if max_output_chars < 1:
        raise ValueError(f"sandbox max_output_chars must be >= 1, got {max_output_chars}")
    if disk_mb < 1:
        raise ValueError(f"sandbox disk_mb (what the code may write, in MB) must be >= 1, got {disk_mb}")


def check_isolation(isolation: str) -> None:
    """Reject an unknown isolation; for ``"kernel"``, raise ``RuntimeError`` if bubblewrap cannot run here."""
    if isolation not in ISOLATIONS:
        raise ValueError(f"sandbox isolation must be one of {ISOLATIONS}, got {isolation!r}")
    if isolation == "kernel":
        require_kernel_isolation()


async def _spawn(config: dict, info_fd: int, disk_bytes: int) -> asyncio.subprocess.Process:
    """Start the child interpreter on the bootstrap, in its own session so its whole group can be killed.

    With an ``info_fd`` (kernel isolation) the child runs under bubblewrap, which reports on that descriptor,
    with ``disk_bytes`` for everything the code writes.
    """
    workdir = config["workdir"]
    environment = {
        "PATH": "/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        # one thread per BLAS library: many sandboxes share the machine, and each thread's
        # arena would count against RLIMIT_AS
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    command = [sys.executable, "-I", "-B", "-c", sandbox_child.bootstrap_source(), json.dumps(config)]
    pass_fds = (config["report_fd"],)
    if info_fd >= 0:
        command = bwrap_command(workdir, environment, info_fd, disk_bytes=disk_bytes) + command
        pass_fds += (info_fd,)
    try:
        return await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            cwd=workdir if info_fd < 0 else None,  # under bubblewrap the path exists only inside
            env=environment,
            start_new_session=True,
            pass_fds=pass_fds,
        )
    except OSError as error:
        raise SandboxError(f"could not start the sandbox interpreter {sys.executable}: {error}") from error


class _Capture:
    """The first ``limit`` bytes of a stream, and a count of the bytes past them."""

    def __init__(self, limit: int):
        self.limit = limit
        self.head = bytearray()
        self.dropped = 0

    async def read_from(self, stream: asyncio.StreamReader) -> None:
        # keep draining past the limit: a child blocked on a full pipe would only ever time out
        while chunk := await stream.read(_READ_CHUNK):
            room = self.limit - len(self.head)
            self.head += chunk[:room]
            self.dropped += max(0, len(chunk) - room)


async def _wait_with_timeout(
    process: asyncio.subprocess.Process, code: bytes, capture: _Capture, timeout: float, info_fd: int = -1
) -> bool:
    """Feed the code, collect output until exit or ``timeout``; always kill the group. True if timed out.

    Under bubblewrap (``info_fd``) the namespace's init is killed first and bubblewrap waited for: the
    kernel ends every process of a PID namespace before its init is reaped, so none survives the call.
    """

    async def communicate() -> None:
        try:
            process.stdin.write(code)
            await process.stdin.drain()
            process.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the child died before reading its code; its exit status says why
        await capture.read_from(process.stdout)
        await process.wait()

    try:
        await asyncio.wait_for(communicate(), timeout)
        return False
    except TimeoutError:  # asyncio's alias since 3.11
        return True
    finally:
        # also on success and on cancellation: nothing the code started may outlive the call
        if info_fd >= 0 and process.returncode is None:
            await _end_namespace(process, info_fd)
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the group is already gone
        await process.wait()


async def _end_namespace(process: asyncio.subprocess.Process, info_fd: int) -> None:
    """SIGKILL the PID namespace's init named on bubblewrap's info pipe, then wait for bubblewrap to exit."""
    try:
        child = int(json.loads(_read_available(info_fd) or "{}").get("child-pid", 0))
        with open(f"/proc/{child}/stat") as stat:  # only our bubblewrap's child: the pid may be reused
            parent = int(stat.read().rpartition(")")[2].split()[1])
        if child > 0 and parent == process.pid:
            os.kill(child, signal.SIGKILL)
            await asyncio.wait_for(process.wait(), 30)  # bubblewrap exits once its child is reaped
    except (ValueError, AttributeError, OSError, TimeoutError):
        pass  # not started yet, or already gone: killing bubblewrap's group below ends it


def _read_available(fd: int) -> str:
    """Everything written to the report pipe; non-blocking, since a killed child may have written nothing."""
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


def _truncate(text: str, dropped_bytes: int, max_chars: int) -> str:
    """``text`` cut to ``max_chars`` with a marker saying how much was cut.

    Bytes dropped while reading are counted as characters: exact for ASCII, an upper bound otherwise.
    """
    cut = len(text) - max_chars + dropped_bytes if len(text) > max_chars or dropped_bytes else 0
    if cut <= 0:
        return text
    return f"{text[:max_chars]}\n[... output truncated: {cut} more characters not shown]"


def _error_of(returncode: int, reported: str, timed_out: bool, timeout: float) -> str | None:
    """The one-line error of a run, or None when it succeeded."""
    if timed_out:
        return f"timed out after {float(timeout)} s"
    if reported:
        return reported
    if returncode < 0:
        try:
            signal_number = signal.Signals(-returncode)
        except ValueError:
            return f"killed by signal {-returncode}"
        if signal_number == signal.SIGXCPU:
            return "CPU time limit exceeded"
        return f"killed by signal {signal_number.name}"
    if returncode != 0:
        return f"exited with status {returncode}"
    return None


def format_observation(result: SandboxResult) -> str:
    """What the agent sees: the output, followed on failure by the error line."""
    if result.ok:
        return result.output or "(no output; print() what you want to see)"
    separator = "\n" if result.output and not result.output.endswith("\n") else ""
    return f"{result.output}{separator}{result.error}"


@TOOLS.register("python")
def python_tool(
    timeout: float = 5.0,
    memory_mb: int = 256,
    max_output_chars: int = 2000,
    disk_mb: int = 64,
    isolation: str = "kernel",
) -> Tool:
    """The ``python`` tool: run code in a sandbox (``run_python_async``) and return its printed output.

    ``isolation="kernel"`` needs bubblewrap and fails here, when the tool is built, if it cannot run;
    ``"process"`` keeps only the in-process layers, which are not a security boundary.
    """
    limits = {"timeout": timeout, "memory_mb": memory_mb, "max_output_chars": max_output_chars, "disk_mb": disk_mb}
    check_limits(**limits)
    check_isolation(isolation)

    async def python(code: str) -> str:
        result = await run_python_async(code, **limits, isolation=isolation)
        return format_observation(result)

    # the first paragraph becomes the description the model sees, so the limits go there
    python.__doc__ = f"""Run Python code in a fresh interpreter and return what it prints; print the result.
        Nothing persists between calls; no network or subprocesses; files only in the current directory;
        stopped after {timeout:g} s or {memory_mb} MB; at most {disk_mb} MB of files; output beyond {max_output_chars} characters is cut.

        Args:
            code: Python source to execute, e.g. "print(sum(range(10)))". Only printed output is returned.
        """
    return tool(python)
