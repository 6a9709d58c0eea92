"""The child side of the Python sandbox (``unipg.tools.sandbox``): these functions run inside the
sandboxed interpreter, not in the trainer.

The parent ships their source with ``-c`` (``bootstrap_source``, the one function here that the parent runs),
because the child cannot import unipg, which would pull in torch. So they use the standard library only, import
it inside themselves, and refer to nothing of this module but each other. ``_child_main`` reads the code from stdin, applies the layers
described in ``unipg.tools.sandbox`` (``_set_limits``, ``_isolate_network``, ``_disable_raw_spawning``,
``_remove_unaudited_calls``, ``_install_guard``), runs the code and reports how it ended.
"""

from __future__ import annotations

import functools
import inspect

_CHILD_FUNCTIONS = (
    "_set_limits",
    "_isolate_network",
    "_disable_raw_spawning",
    "_remove_unaudited_calls",
    "_read_roots",
    "_path_checks",
    "_guard_rules",
    "_install_guard",
    "_child_main",
)


@functools.lru_cache(maxsize=1)
def bootstrap_source() -> str:
    """The program the child runs: the functions below, then ``_child_main()`` (parent side)."""
    sources = [inspect.getsource(globals()[name]) for name in _CHILD_FUNCTIONS]
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

    limits = {
        resource.RLIMIT_AS: config["memory_bytes"],
        resource.RLIMIT_CPU: config["cpu_seconds"],
        resource.RLIMIT_FSIZE: config["file_bytes"],
        resource.RLIMIT_CORE: 0,
    }
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

    unaudited = {
        (os, posix): (
            "mknod",
            "mkfifo",
            "pidfd_open",
            "setpriority",
            "sched_setaffinity",
            "sched_setscheduler",
            "sched_setparam",
        ),
        (signal, _signal): ("pidfd_send_signal",),
    }
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
    roots = [
        workdir,
        *(paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib")),
        *site.getsitepackages(),
    ]
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
            raise PermissionError(f"writing outside the working directory is not allowed in the sandbox: {resolved}")

    def refuse_read(path) -> None:
        resolved = resolve(path)
        if not below(resolved, read_roots):
            raise PermissionError(
                f"reading {resolved} is not allowed in the sandbox: only the working directory "
                f"and the Python libraries can be read"
            )

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
            raise PermissionError(
                f"opening directories outside the working directory as descriptors "
                f"is not allowed in the sandbox: {path}"
            )

    return resolve, refuse_write, refuse_read, check_open


def _guard_rules() -> tuple:
    """``(refused, path_events, read_events, blocked_imports, blocked_prefixes)``: the audit hook's rules, built
    fresh for ``_install_guard``, which binds them before it installs the hook (child side)."""
    refused = {
        "socket.": "network access",
        "ctypes.": "ctypes",
        "subprocess.": "starting processes",
        "os.exec": "starting processes",
        "os.posix_spawn": "starting processes",
        "os.fork": "starting processes",
        "os.system": "starting processes",
        "os.kill": "signalling processes",
        "resource.": "changing resource limits",
        # SQL's ATTACH opens any file, out of the hook's sight
        "sqlite3.": "opening sqlite3 databases",
        # a new interpreter does not inherit this hook
        "cpython.PyInterpreterState_New": "starting interpreters",
    }
    # event -> (path argument, dir_fd argument or None) of every path the event modifies
    path_events = {
        "os.rename": ((0, 2), (1, 3)),
        "os.link": ((0, 2), (1, 3)),
        "os.remove": ((0, 1),),
        "os.rmdir": ((0, 1),),
        "os.mkdir": ((0, 2),),
        "os.chmod": ((0, 2),),
        "os.chown": ((0, 3),),
        "os.utime": ((0, 3),),
        "os.truncate": ((0, None),),
        "os.setxattr": ((0, None),),
        "os.removexattr": ((0, None),),
        "os.chflags": ((0, None),),
    }
    # directory listings (glob, os.walk and pathlib go through these) and extended attributes
    read_events = ("os.listdir", "os.scandir", "os.listxattr", "os.getxattr")
    # modules that run code or touch files or processes with no audit event: Tcl runs programs, a
    # subinterpreter has no hook, readline/OpenSSL/pwd read files, _posixshmem and syslog write outside
    blocked_imports = {
        "ctypes",
        "_ctypes",
        "_posixsubprocess",
        "posix",
        "_signal",
        "_tkinter",
        "readline",
        "_ssl",
        "_posixshmem",
        "syslog",
        "pwd",
        "grp",
        "spwd",
        "nis",
    }
    blocked_prefixes = ("ctypes.", "_xxsubinterpreters", "_xxinterpchannels", "_test")
    return refused, path_events, read_events, blocked_imports, blocked_prefixes


def _install_guard(workdir: str, read_roots: tuple) -> None:
    """Install the audit hook that refuses network, processes, ctypes, and file access outside the rules.

    Everything the hook uses is bound when it is installed, so patching module globals cannot change it.
    """
    import os
    import sys

    resolve, refuse_write, refuse_read, check_open = _path_checks(workdir, read_roots)
    join, dirname, fsdecode = os.path.join, os.path.dirname, os.fsdecode
    refused, path_events, read_events, blocked_imports, blocked_prefixes = _guard_rules()
    refused_prefixes = tuple(refused)

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
