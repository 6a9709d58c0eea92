"""Kernel isolation for the Python sandbox: the ``bwrap`` (bubblewrap) command line the child runs under.

The child interpreter gets its own user, mount, PID, network, IPC, UTS and cgroup namespaces, no
capabilities, and a root file system holding only: the working directory (read-write), the interpreter and
the libraries it imports (read-only), ``/usr/lib`` and ``/lib`` for shared libraries (read-only), a private
``/proc``, a minimal ``/dev`` and an empty ``/tmp``. The child is the PID namespace's init, so when it ends
or is killed every process it started dies with it.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

MISSING = (
    "the python tool needs bubblewrap (apt-get install bubblewrap) for a kernel-enforced sandbox; or set "
    "options {isolation: process} to run with the in-process audit hook only (not a security boundary)"
)
_SHARED_LIBRARIES = ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/local/lib")


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
    existing = {path for path in paths if os.path.lexists(path)}
    # a path inside another bound path is already visible
    kept = [
        path for path in existing if not any(path != other and path.startswith(other + os.sep) for other in existing)
    ]
    return tuple(sorted(kept, key=lambda path: (path.count(os.sep), path)))


def bwrap_command(workdir: str, environment: dict, info_fd: int | None = None) -> list[str]:
    """The ``bwrap`` arguments up to the child's own command line, for a child working in ``workdir``."""
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
        "--tmpfs",
        "/tmp",
    ]
    for path in read_only_paths():
        if os.path.islink(path):  # /lib -> usr/lib on merged-/usr systems: recreate the link, bind its target
            command += ["--symlink", os.readlink(path), path]
        else:
            command += ["--ro-bind", path, path]
    command += ["--bind", workdir, workdir, "--chdir", workdir, "--clearenv"]
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
    with tempfile.TemporaryDirectory(prefix="unipg-sandbox-probe-") as workdir:
        workdir = os.path.realpath(workdir)
        command = bwrap_command(workdir, {"PATH": "/usr/bin:/bin"}) + [sys.executable, "-I", "-B", "-c", "pass"]
        try:
            return subprocess.run(command, capture_output=True, timeout=60, check=False).returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False


def require_kernel_isolation() -> None:
    """Raise ``RuntimeError`` with the remedy when the kernel sandbox cannot be used here."""
    if not kernel_isolation_available():
        raise RuntimeError(MISSING)
