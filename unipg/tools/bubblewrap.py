"""Kernel isolation for the Python sandbox: the ``bwrap`` (bubblewrap) command line the child runs under.

The child interpreter gets its own user, mount, PID, network, IPC, UTS and cgroup namespaces, no
capabilities, and a read-only root file system holding only: the interpreter and the libraries it imports,
``/usr/lib`` and ``/lib`` for shared libraries, a private ``/proc``, a minimal read-only ``/dev`` with a 1 MB
``/dev/shm`` for semaphores, and a private ``/tmp`` holding the working directory. That ``/tmp`` is a tmpfs of
``disk_bytes``; with ``/dev/shm`` the only writable places, so everything the code writes, in memory pages, is
bounded by ``disk_bytes + SHM_BYTES``: past it a write fails with ``ENOSPC`` ("No space left on device"). The child is the PID namespace's init, so when it ends or is killed every process it started
dies with it.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import sysconfig

MISSING = (
    "the python tool needs bubblewrap (apt-get install bubblewrap) for a kernel-enforced sandbox; or set "
    "options {isolation: process} to run with the in-process audit hook only (not a security boundary)"
)
_SHARED_LIBRARIES = ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/local/lib")
SHM_BYTES = 1 << 20  # /dev/shm, for multiprocessing's semaphores (one page each); added to disk_bytes


@functools.lru_cache(maxsize=1)
def read_only_paths() -> tuple[str, ...]:
    """The host paths the child interpreter needs to start and import its libraries, outermost first.

    The interpreter's prefixes contribute their ``bin`` (the executable and the links to it), ``lib`` and
    ``pyvenv.cfg`` only; the site-packages and standard library come from ``sysconfig``.
    """
    paths = set()
    for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}:
        paths.update(os.path.join(prefix, name) for name in ("bin", "lib", "lib64", "pyvenv.cfg"))
    for scheme_paths in (
        sysconfig.get_paths(),
        sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix}),
    ):
        paths.update(scheme_paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib"))
    paths.update((sys.executable, os.path.realpath(sys.executable)))
    paths.update(_SHARED_LIBRARIES)
    # the time zone database for zoneinfo (the tzdata package is only its fallback, and not always installed)
    paths.update((sysconfig.get_config_var("TZPATH") or "/usr/share/zoneinfo").split(os.pathsep))
    existing = {path for path in paths if os.path.lexists(path)}
    # a path inside another bound path is already visible
    kept = [
        path for path in existing if not any(path != other and path.startswith(other + os.sep) for other in existing)
    ]
    return tuple(sorted(kept, key=lambda path: (path.count(os.sep), path)))


def sandbox_workdir(host_workdir: str) -> str:
    """The child's working directory inside the sandbox: a folder of the same name on its private ``/tmp``."""
    return os.path.join("/tmp", os.path.basename(host_workdir))


def bwrap_command(workdir: str, environment: dict, info_fd: int | None = None, *, disk_bytes: int) -> list[str]:
    """The ``bwrap`` arguments up to the child's own command line, for a child working in ``workdir``.

    ``workdir`` is a path below ``/tmp`` (``sandbox_workdir``); ``disk_bytes`` bounds everything written there.
    """
    if os.path.dirname(workdir) != "/tmp":
        raise ValueError(f"the sandbox's working directory must be a folder of its /tmp, got {workdir}")
    command = [
        "bwrap",
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--as-pid-1",
        "--cap-drop",
        "ALL",
        # the fresh /tmp comes before the binds: an interpreter installed under /tmp stays visible
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(SHM_BYTES),
        "--tmpfs",
        "/dev/shm",
        "--size",
        str(disk_bytes),
        "--tmpfs",
        "/tmp",
    ]
    for path in read_only_paths():
        if os.path.islink(path):  # /lib -> usr/lib on merged-/usr systems: recreate the link, bind its target
            command += ["--symlink", os.readlink(path), path]
        else:
            command += ["--ro-bind", path, path]
    # the working directory shares the sized /tmp; the root tmpfs and /dev's tmpfs (not their device nodes,
    # which are mounts of their own) become read-only, so no other place takes writes
    command += ["--dir", workdir, "--chdir", workdir, "--remount-ro", "/dev", "--remount-ro", "/", "--clearenv"]
    for key, value in environment.items():
        command += ["--setenv", key, value]
    if info_fd is not None:
        command += ["--info-fd", str(info_fd)]
    return command + ["--"]


@functools.lru_cache(maxsize=1)
def kernel_isolation_available() -> bool:
    """True if ``bwrap`` is on PATH and can start the interpreter in new namespaces (probed once)."""
    if shutil.which("bwrap") is None:
        return False
    command = bwrap_command("/tmp/probe", {"PATH": "/usr/bin:/bin"}, disk_bytes=1 << 20)
    command += [sys.executable, "-I", "-B", "-c", "pass"]
    try:
        return subprocess.run(command, capture_output=True, timeout=60, check=False).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def require_kernel_isolation() -> None:
    """Raise ``RuntimeError`` with the remedy when the kernel sandbox cannot be used here."""
    if not kernel_isolation_available():
        raise RuntimeError(MISSING)
