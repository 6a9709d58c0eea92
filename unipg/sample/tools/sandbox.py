"""A Python sandbox tool: run a model's code in a fresh, limited interpreter and return what it prints.

Every call starts ``sys.executable -I -B`` (isolated mode: no user site, no ``PYTHON*`` variables, no
bytecode written) in a new session, with a stripped environment and a fresh temporary working directory
that is deleted afterwards. The code travels over stdin, never through a shell. Protection comes in
layers, each enforced by the operating system or by the interpreter itself:

1. **Wall clock.** The whole process group is killed with SIGKILL after ``timeout`` seconds.
2. **Resource limits** (``setrlimit`` in the child, soft = hard, so the code cannot raise them back):
   ``RLIMIT_AS`` (``memory_mb``; exceeding it raises ``MemoryError`` in the child, the parent is unaffected),
   ``RLIMIT_CPU`` (a backstop, slightly above ``timeout``), ``RLIMIT_FSIZE`` (10 MB per file) and
   ``RLIMIT_CORE`` 0. ``RLIMIT_NPROC`` is not set: it counts every process of the user, trainer included,
   and starting processes is refused by layer 3 anyway.
3. **An audit hook** (PEP 578), installed before the code runs, refuses with ``PermissionError``: sockets
   and name lookups; starting processes (``subprocess``, ``multiprocessing``, ``os.system``, ``os.exec*``,
   ``os.posix_spawn``, ``os.fork``), new interpreters, and signalling processes (``os.kill``); every
   ``ctypes`` event; ``sqlite3`` connections (SQL's ``ATTACH`` opens any file out of the hook's sight);
   raising resource limits; creating, writing, renaming, removing or chmod-ing any path that resolves outside
   the working directory; and reading or listing any path outside the *read roots*: the working directory,
   the interpreter's standard library and site-packages, the time-zone database, ``/dev/null``,
   ``/dev/urandom`` and the child's own ``/proc/<pid>``. So the trainer's run folder, ``/etc/passwd`` and
   ``/proc/<trainer pid>/environ`` (its API keys) are refused. Importing modules that reach outside with no
   audit event is an ``ImportError`` (so libraries that merely try them, such as NumPy with ``ctypes``, still
   load): ``ctypes``, ``_tkinter`` (Tcl runs programs), subinterpreters, ``readline``, ``_ssl`` and ``pwd``
   (they read files), ``_posixshmem`` and ``syslog`` (they write outside). ``os.mknod``, ``os.mkfifo``,
   ``os.pidfd_open``, ``signal.pidfd_send_signal`` and the calls that set another process's priority or
   CPUs are deleted before the code runs, and re-importing ``posix`` or ``_signal`` to get them back is
   refused. The environment is rebuilt from scratch, so none of the trainer's variables is inherited.
4. **Network namespace.** When the kernel allows unprivileged user namespaces, the child also moves into
   a new user + network namespace (only a downed loopback exists, and root in it can no longer raise its
   limits). Failure is ignored: this layer is a bonus, the hook is what the tests rely on.

Limits, honestly: an audit hook runs inside the process it guards, so it is not a security boundary
against a determined attacker (introspection can reach the hook's objects; a path is checked, then opened,
so two threads racing a symlink swap can win; C extensions in site-packages can read, write and start
processes without any event); it stops accidental and casual misuse by a model. Calls with no audit event
still work outside the working directory: ``os.stat``, ``os.path.exists``, ``os.access`` and
``os.readlink`` reveal whether a path exists, its size and times, and where a link points (for example
which files ``/proc/<trainer pid>/fd`` holds open), though never a file's content. Libraries that need
``ctypes`` at import, such as SymPy, cannot be used. For untrusted code at scale, run this inside a
container or gVisor as well.

``run_python_async`` is the implementation (asyncio subprocesses, so many episodes can run sandboxes at
once without threads); ``run_python`` is its synchronous wrapper. The tool is registered as ``"python"``.
The code that runs inside the child, applying layers 2 to 4, is in ``unipg.sample.tools.sandbox_child``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import math
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

from unipg.sample.tools import sandbox_child
from unipg.sample.tools.bubblewrap import bwrap_command, require_kernel_isolation
from unipg.sample.tools.base import TOOLS, Tool, tool

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


def run_python(code: str, *, timeout: float = 5.0, memory_mb: int = 256, max_output_chars: int = 2000,
               isolation: str = "kernel") -> SandboxResult:
    """Run ``code`` in a fresh sandboxed interpreter; synchronous wrapper of ``run_python_async``.

    Uses ``asyncio.run``, so call it from plain code; inside an event loop ``await run_python_async``.
    """
    return asyncio.run(run_python_async(code, timeout=timeout, memory_mb=memory_mb,
                                        max_output_chars=max_output_chars, isolation=isolation))


async def run_python_async(code: str, *, timeout: float = 5.0, memory_mb: int = 256, max_output_chars: int = 2000,
                           isolation: str = "kernel") -> SandboxResult:
    """Run ``code`` in a fresh sandboxed interpreter (see the module docstring for the layers).

    Errors of the code (exceptions, limits, timeouts) are reported in the result; ``SandboxError`` is
    raised only when the interpreter could not be started or set up. ``isolation="kernel"`` (the default)
    runs the child under bubblewrap and raises ``RuntimeError`` when bubblewrap cannot be used here.
    """
    check_limits(timeout=timeout, memory_mb=memory_mb, max_output_chars=max_output_chars)
    check_isolation(isolation)
    start = time.monotonic()
    # ignore_cleanup_errors: the code may leave read-only files behind; TemporaryDirectory still
    # resets permissions and removes them, and a failure there must not hide the result
    with tempfile.TemporaryDirectory(prefix="unipg-sandbox-", ignore_cleanup_errors=True) as workdir:
        report_read, report_write = os.pipe()  # a private channel for "ready" and the exception line
        # bubblewrap writes the host pid of the namespace's init (the child) here
        info_read, info_write = os.pipe() if isolation == "kernel" else (-1, -1)
        try:
            config = {"workdir": os.path.realpath(workdir), "report_fd": report_write,
                      "memory_bytes": memory_mb << 20, "cpu_seconds": math.ceil(timeout) + 1,
                      "file_bytes": MAX_FILE_BYTES}
            process = await _spawn(config, info_write)
            for fd in (report_write, info_write):
                if fd >= 0:
                    os.close(fd)
            report_write = info_write = -1
            # UTF-8 takes at most 4 bytes a character, so this head always holds max_output_chars + 1
            capture = _Capture(limit=4 * max_output_chars + 4)
            timed_out = await _wait_with_timeout(process, code.encode("utf-8", "replace"), capture, timeout,
                                                 info_read)
            report = _read_available(report_read)
        finally:
            for fd in (report_read, report_write, info_read, info_write):
                if fd >= 0:
                    os.close(fd)
    output = _truncate(capture.head.decode("utf-8", "replace"), capture.dropped, max_output_chars)
    if not report.startswith("ready\n") and not timed_out:
        raise SandboxError(f"the sandbox interpreter failed before running the code "
                           f"(exit status {process.returncode}): {output[-1000:]}")
    error = _error_of(process.returncode, report.removeprefix("ready\n").strip(), timed_out, timeout)
    return SandboxResult(output, error is None, timed_out, error, time.monotonic() - start)


def check_limits(*, timeout: float, memory_mb: int, max_output_chars: int) -> None:
    """Reject limits the sandbox cannot honour, with the reason."""
    if not timeout > 0:
        raise ValueError(f"sandbox timeout must be > 0 seconds, got {timeout}")
    if memory_mb < MIN_MEMORY_MB:
        raise ValueError(f"sandbox memory_mb must be >= {MIN_MEMORY_MB} (the interpreter itself needs it), "
                         f"got {memory_mb}")
    if max_output_chars < 1:
        raise ValueError(f"sandbox max_output_chars must be >= 1, got {max_output_chars}")


def check_isolation(isolation: str) -> None:
    """Reject an unknown isolation; for ``"kernel"``, raise ``RuntimeError`` if bubblewrap cannot run here."""
    if isolation not in ISOLATIONS:
        raise ValueError(f"sandbox isolation must be one of {ISOLATIONS}, got {isolation!r}")
    if isolation == "kernel":
        require_kernel_isolation()


async def _spawn(config: dict, info_fd: int) -> asyncio.subprocess.Process:
    """Start the child interpreter on the bootstrap, in its own session so its whole group can be killed.

    With an ``info_fd`` (kernel isolation) the child runs under bubblewrap, which reports on that descriptor.
    """
    workdir = config["workdir"]
    environment = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
                   "LC_ALL": "C.UTF-8",
                   # one thread per BLAS library: many sandboxes share the machine, and each thread's
                   # arena would count against RLIMIT_AS
                   "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    command = [sys.executable, "-I", "-B", "-c", _bootstrap_source(), json.dumps(config)]
    pass_fds = (config["report_fd"],)
    if info_fd >= 0:
        command = bwrap_command(workdir, environment, info_fd) + command
        pass_fds += (info_fd,)
    try:
        return await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, cwd=workdir, env=environment, start_new_session=True,
            pass_fds=pass_fds)
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


async def _wait_with_timeout(process: asyncio.subprocess.Process, code: bytes, capture: _Capture,
                             timeout: float, info_fd: int = -1) -> bool:
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
def python_tool(timeout: float = 5.0, memory_mb: int = 256, max_output_chars: int = 2000,
                isolation: str = "kernel") -> Tool:
    """The ``python`` tool: run code in a sandbox (``run_python_async``) and return its printed output.

    ``isolation="kernel"`` needs bubblewrap and fails here, when the tool is built, if it cannot run;
    ``"process"`` keeps only the in-process layers, which are not a security boundary.
    """
    check_limits(timeout=timeout, memory_mb=memory_mb, max_output_chars=max_output_chars)
    check_isolation(isolation)

    async def python(code: str) -> str:
        result = await run_python_async(code, timeout=timeout, memory_mb=memory_mb,
                                        max_output_chars=max_output_chars, isolation=isolation)
        return format_observation(result)

    # the first paragraph becomes the description the model sees, so the limits go there
    python.__doc__ = f"""Run Python code in a fresh interpreter and return what it prints; print the result.
        Nothing persists between calls; no network or subprocesses; files only in the current directory;
        stopped after {timeout:g} s or {memory_mb} MB; output beyond {max_output_chars} characters is cut.

        Args:
            code: Python source to execute, e.g. "print(sum(range(10)))". Only printed output is returned.
        """
    return tool(python)


# ---- the child's program -------------------------------------------------------------------------------
# The child runs the functions of ``unipg.sample.tools.sandbox_child``, shipped as source with ``-c``: it
# cannot import unipg, which would pull in torch.

_CHILD_FUNCTIONS = ("_set_limits", "_isolate_network", "_disable_raw_spawning", "_remove_unaudited_calls",
                    "_read_roots", "_path_checks", "_install_guard", "_child_main")


@functools.lru_cache(maxsize=1)
def _bootstrap_source() -> str:
    """The program the child runs: the functions of ``sandbox_child``, then ``_child_main()``."""
    sources = [inspect.getsource(getattr(sandbox_child, name)) for name in _CHILD_FUNCTIONS]
    return "from __future__ import annotations\n\n" + "\n\n".join(sources) + "\n_child_main()\n"
