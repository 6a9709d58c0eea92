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

from unipg.sample.tools.base import TOOLS, Tool, tool

MAX_FILE_BYTES = 10 << 20  # RLIMIT_FSIZE: the largest file the code may write
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


def run_python(code: str, *, timeout: float = 5.0, memory_mb: int = 256,
               max_output_chars: int = 2000) -> SandboxResult:
    """Run ``code`` in a fresh sandboxed interpreter; synchronous wrapper of ``run_python_async``.

    Uses ``asyncio.run``, so call it from plain code; inside an event loop ``await run_python_async``.
    """
    return asyncio.run(run_python_async(code, timeout=timeout, memory_mb=memory_mb,
                                        max_output_chars=max_output_chars))


async def run_python_async(code: str, *, timeout: float = 5.0, memory_mb: int = 256,
                           max_output_chars: int = 2000) -> SandboxResult:
    """Run ``code`` in a fresh sandboxed interpreter (see the module docstring for the layers).

    Errors of the code (exceptions, limits, timeouts) are reported in the result; ``SandboxError`` is
    raised only when the interpreter could not be started or set up.
    """
    check_limits(timeout=timeout, memory_mb=memory_mb, max_output_chars=max_output_chars)
    start = time.monotonic()
    # ignore_cleanup_errors: the code may leave read-only files behind; TemporaryDirectory still
    # resets permissions and removes them, and a failure there must not hide the result
    with tempfile.TemporaryDirectory(prefix="unipg-sandbox-", ignore_cleanup_errors=True) as workdir:
        report_read, report_write = os.pipe()  # a private channel for "ready" and the exception line
        try:
            config = {"workdir": os.path.realpath(workdir), "report_fd": report_write,
                      "memory_bytes": memory_mb << 20, "cpu_seconds": math.ceil(timeout) + 1,
                      "file_bytes": MAX_FILE_BYTES}
            process = await _spawn(config, workdir)
            os.close(report_write)
            report_write = -1
            # UTF-8 takes at most 4 bytes a character, so this head always holds max_output_chars + 1
            capture = _Capture(limit=4 * max_output_chars + 4)
            timed_out = await _wait_with_timeout(process, code.encode("utf-8", "replace"), capture, timeout)
            report = _read_available(report_read)
        finally:
            for fd in (report_read, report_write):
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


async def _spawn(config: dict, workdir: str) -> asyncio.subprocess.Process:
    """Start the child interpreter on the bootstrap, in its own session so its whole group can be killed."""
    environment = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
                   "LC_ALL": "C.UTF-8",
                   # one thread per BLAS library: many sandboxes share the machine, and each thread's
                   # arena would count against RLIMIT_AS
                   "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    try:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-B", "-c", _bootstrap_source(), json.dumps(config),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            cwd=workdir, env=environment, start_new_session=True, pass_fds=(config["report_fd"],))
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
                             timeout: float) -> bool:
    """Feed the code, collect output until exit or ``timeout``; always kill the group. True if timed out."""

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
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the group is already gone
        await process.wait()


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
def python_tool(timeout: float = 5.0, memory_mb: int = 256, max_output_chars: int = 2000) -> Tool:
    """The ``python`` tool: run code in a sandbox (``run_python_async``) and return its printed output."""
    check_limits(timeout=timeout, memory_mb=memory_mb, max_output_chars=max_output_chars)

    async def python(code: str) -> str:
        result = await run_python_async(code, timeout=timeout, memory_mb=memory_mb,
                                        max_output_chars=max_output_chars)
        return format_observation(result)

    # the first paragraph becomes the description the model sees, so the limits go there
    python.__doc__ = f"""Run Python code in a fresh interpreter and return what it prints; print the result.
        Nothing persists between calls; no network or subprocesses; files only in the current directory;
        stopped after {timeout:g} s or {memory_mb} MB; output beyond {max_output_chars} characters is cut.

        Args:
            code: Python source to execute, e.g. "print(sum(range(10)))". Only printed output is returned.
        """
    return tool(python)


# ---- child side ----------------------------------------------------------------------------------------
# The functions below run inside the sandboxed interpreter. Their source is shipped with ``-c`` (the child
# cannot import unipg, which would pull in torch), so they use the standard library only and import it
# inside themselves.

_CHILD_FUNCTIONS = ("_set_limits", "_isolate_network", "_disable_raw_spawning", "_remove_unaudited_calls",
                    "_read_roots", "_path_checks", "_install_guard", "_child_main")


@functools.lru_cache(maxsize=1)
def _bootstrap_source() -> str:
    """The program the child runs: the child-side functions of this module, then ``_child_main()``."""
    module = sys.modules[__name__]
    sources = [inspect.getsource(getattr(module, name)) for name in _CHILD_FUNCTIONS]
    return "from __future__ import annotations\n\n" + "\n\n".join(sources) + "\n_child_main()\n"


def _child_main() -> None:
    """Read the code from stdin, apply every layer, run the code and report how it ended (child side)."""
    import json
    import os
    import sys

    config = json.loads(sys.argv[1])
    code = sys.stdin.buffer.read().decode("utf-8")  # UTF-8 whatever the locale, as the parent encodes it
    sys.argv = ["<sandbox>"]
    # line buffering keeps prints and tracebacks in order in the shared stdout/stderr pipe
    sys.stdout.reconfigure(line_buffering=True)
    _set_limits(config)
    _isolate_network()
    _disable_raw_spawning()
    _remove_unaudited_calls()
    _install_guard(config["workdir"], _read_roots(config["workdir"]))
    os.write(config["report_fd"], b"ready\n")
    error = ""
    try:
        exec(compile(code, "<sandbox>", "exec"), {"__name__": "__main__"})  # noqa: S102 - the point of it
    except SystemExit as stop:
        if stop.code not in (None, 0):
            error = f"SystemExit: {stop.code}"
    except BaseException as exception:  # noqa: BLE001 - every failure of the code is an observation
        try:
            message = str(exception)
        except Exception:  # noqa: BLE001 - a broken __str__ must not hide the type
            message = ""
        error = f"{type(exception).__name__}: {message}" if message else type(exception).__name__
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110 - the code may have closed or replaced its streams
            pass
    try:
        os.write(config["report_fd"], error[:4000].encode("utf-8", "replace"))
    except OSError:
        pass  # the code closed the report pipe; the run then reads as successful or by its exit status


def _set_limits(config: dict) -> None:
    """Soft = hard limits on memory, CPU time, file size and core dumps (child side)."""
    import resource

    limits = {resource.RLIMIT_AS: config["memory_bytes"], resource.RLIMIT_CPU: config["cpu_seconds"],
              resource.RLIMIT_FSIZE: config["file_bytes"], resource.RLIMIT_CORE: 0}
    for limit, value in limits.items():
        _, hard = resource.getrlimit(limit)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)  # without privileges a hard limit can only go down
        resource.setrlimit(limit, (value, value))


def _isolate_network() -> bool:
    """Enter a new user + network namespace if the kernel allows it; True on success (child side)."""
    import os
    import sys

    flags = 0x10000000 | 0x40000000  # CLONE_NEWUSER | CLONE_NEWNET from <linux/sched.h>
    try:
        if hasattr(os, "unshare"):  # Python >= 3.12
            os.unshare(flags)
            return True
        import ctypes

        return ctypes.CDLL(None, use_errno=True).unshare(flags) == 0
    except (OSError, AttributeError):
        return False  # no namespaces here (macOS, a seccomp profile, a sysctl): the audit hook remains
    finally:
        # forget ctypes, so that importing it again goes through the audit hook, which refuses it
        loaded = [name for name in sys.modules if name.startswith(("ctypes.", "_ctypes")) or name == "ctypes"]
        for name in loaded:
            del sys.modules[name]


def _disable_raw_spawning() -> None:
    """Replace ``_posixsubprocess.fork_exec``, which starts processes without raising an audit event."""
    import _posixsubprocess
    import sys

    def fork_exec(*args, **kwargs):
        raise PermissionError("starting processes is not allowed in the sandbox")

    _posixsubprocess.fork_exec = fork_exec
    if "subprocess" in sys.modules:  # it binds its own reference on import
        sys.modules["subprocess"]._fork_exec = fork_exec


def _remove_unaudited_calls() -> None:
    """Delete the ``os`` and ``signal`` functions that reach outside without raising an audit event (child side).

    ``mknod`` and ``mkfifo`` create files anywhere; ``pidfd_open`` with ``pidfd_send_signal`` signals any process
    of the same user, the trainer included; the scheduling calls change the priority or CPUs of other processes.
    The hook refuses re-importing ``posix`` and ``_signal``, which would bring them back.
    """
    import _signal
    import os
    import posix
    import signal

    unaudited = {(os, posix): ("mknod", "mkfifo", "pidfd_open", "setpriority", "sched_setaffinity",
                               "sched_setscheduler", "sched_setparam"),
                 (signal, _signal): ("pidfd_send_signal",)}
    for modules, names in unaudited.items():
        for module in modules:
            for name in names:
                if hasattr(module, name):
                    delattr(module, name)


def _read_roots(workdir: str) -> tuple:
    """The resolved paths the code may read below: its workdir, the interpreter's libraries, a few system files.

    Computed in the child before the hook is installed (child side). Only the child's own ``/proc/<pid>``
    is readable: ``/proc/<parent>/environ`` holds the trainer's API keys.
    """
    import os
    import site
    import sys
    import sysconfig

    paths = sysconfig.get_paths()
    roots = [workdir, *(paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib")),
             *site.getsitepackages()]
    # sys.path entries below the interpreter's prefixes: lib-dynload, a zipped stdlib, Debian's dist-packages
    # (not every entry: an editable install puts a source checkout, and its run folders, on sys.path)
    prefixes = {os.path.realpath(prefix) + os.sep for prefix in (sys.prefix, sys.base_prefix)}
    roots += [entry for entry in sys.path if entry and os.path.realpath(entry).startswith(tuple(prefixes))]
    # time zones for zoneinfo and datetime; random bytes for os.urandom fallbacks and numpy seeding
    roots += (sysconfig.get_config_var("TZPATH") or "/usr/share/zoneinfo").split(os.pathsep)
    roots += ["/etc/localtime", os.devnull, "/dev/urandom", "/dev/random", f"/proc/{os.getpid()}"]
    return tuple(sorted({os.path.realpath(root) for root in roots if root}))


def _path_checks(workdir: str, read_roots: tuple) -> tuple:
    """``(resolve, refuse_write, refuse_read, check_open)``: where a path really points, and the rules (child side).

    Writing is allowed only inside ``workdir``; reading only below ``read_roots``. Paths are compared after
    ``realpath``, so a link inside pointing outside counts as outside.
    """
    import os

    realpath, join, fsdecode, isdir, separator = os.path.realpath, os.path.join, os.fsdecode, os.path.isdir, os.sep
    writable = (workdir, os.devnull)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def resolve(path, dir_fd=None) -> str:
        if path is None:  # os.listdir() and os.scandir() without an argument
            path = "."
        if isinstance(path, int):  # a file descriptor: the file it is open on
            return realpath(f"/proc/self/fd/{path}")
        path = fsdecode(path)
        if isinstance(dir_fd, int) and dir_fd >= 0:
            path = join(f"/proc/self/fd/{dir_fd}", path)
        return realpath(path)  # follows symlinks, so a link inside pointing outside counts as outside

    def below(resolved: str, roots: tuple) -> bool:
        return any(resolved == root or resolved.startswith(root + separator) for root in roots)

    def refuse_write(path, dir_fd=None) -> None:
        resolved = resolve(path, dir_fd)
        if not below(resolved, writable):
            raise PermissionError(f"writing outside the working directory is not allowed in the sandbox: "
                                  f"{resolved}")

    def refuse_read(path) -> None:
        resolved = resolve(path)
        if not below(resolved, read_roots):
            raise PermissionError(f"reading {resolved} is not allowed in the sandbox: only the working directory "
                                  f"and the Python libraries can be read")

    def check_open(path, mode, flags) -> None:
        if isinstance(path, int):
            return  # reopening a descriptor grants no access it did not have
        if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags or 0) & write_flags:
            refuse_write(path)
            return
        refuse_read(path)
        resolved = resolve(path)
        if mode is None and not below(resolved, (workdir,)) and isdir(resolved):
            # os.open(dir) would give a dir_fd for os.open(name, dir_fd=...), whose event omits it
            raise PermissionError(f"opening directories outside the working directory as descriptors "
                                  f"is not allowed in the sandbox: {path}")

    return resolve, refuse_write, refuse_read, check_open


def _install_guard(workdir: str, read_roots: tuple) -> None:
    """Install the audit hook that refuses network, processes, ctypes, and file access outside the rules.

    Everything the hook uses is bound when it is installed, so patching module globals cannot change it.
    """
    import os
    import sys

    resolve, refuse_write, refuse_read, check_open = _path_checks(workdir, read_roots)
    join, dirname, fsdecode = os.path.join, os.path.dirname, os.fsdecode
    refused = {"socket.": "network access", "ctypes.": "ctypes", "subprocess.": "starting processes",
               "os.exec": "starting processes", "os.posix_spawn": "starting processes",
               "os.fork": "starting processes", "os.system": "starting processes",
               "os.kill": "signalling processes", "resource.": "changing resource limits",
               # SQL's ATTACH opens any file, out of the hook's sight
               "sqlite3.": "opening sqlite3 databases",
               # a new interpreter does not inherit this hook
               "cpython.PyInterpreterState_New": "starting interpreters"}
    refused_prefixes = tuple(refused)
    # event -> (path argument, dir_fd argument or None) of every path the event modifies
    path_events = {"os.rename": ((0, 2), (1, 3)), "os.link": ((0, 2), (1, 3)), "os.remove": ((0, 1),),
                   "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),), "os.chmod": ((0, 2),), "os.chown": ((0, 3),),
                   "os.utime": ((0, 3),), "os.truncate": ((0, None),), "os.setxattr": ((0, None),),
                   "os.removexattr": ((0, None),), "os.chflags": ((0, None),)}
    # directory listings (glob, os.walk and pathlib go through these) and extended attributes
    read_events = ("os.listdir", "os.scandir", "os.listxattr", "os.getxattr")
    # modules that run code or touch files or processes with no audit event: Tcl runs programs, a
    # subinterpreter has no hook, readline/OpenSSL/pwd read files, _posixshmem and syslog write outside
    blocked_imports = {"ctypes", "_ctypes", "_posixsubprocess", "posix", "_signal", "_tkinter", "readline", "_ssl",
                       "_posixshmem", "syslog", "pwd", "grp", "spwd", "nis"}
    blocked_prefixes = ("ctypes.", "_xxsubinterpreters", "_xxinterpchannels", "_test")

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            check_open(*args)
        elif event in read_events:
            refuse_read(args[0])
        elif event in path_events:
            for path_index, dir_fd_index in path_events[event]:
                refuse_write(args[path_index], None if dir_fd_index is None else args[dir_fd_index])
        elif event == "os.symlink":
            source, destination, dir_fd = args
            refuse_write(destination, dir_fd)
            # a link may only point inside, so that writes through it stay inside too
            refuse_write(join(dirname(resolve(destination, dir_fd)), fsdecode(source)))
        elif event == "import" and (args[0] in blocked_imports or args[0].startswith(blocked_prefixes)):
            # ImportError, not PermissionError: libraries that only try ctypes (NumPy) fall back cleanly
            raise ImportError(f"importing {args[0]} is not allowed in the sandbox")
        elif event.startswith(refused_prefixes):
            what = next(refused[prefix] for prefix in refused_prefixes if event.startswith(prefix))
            raise PermissionError(f"{what} is not allowed in the sandbox ({event})")

    sys.addaudithook(hook)
