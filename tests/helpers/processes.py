"""Processes seen through /proc: whether one still runs, and which mention a text in their command line."""

import os


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a child not yet reaped is a zombie: it has stopped
        return stat.read().split(")")[-1].split()[0] != "Z"


def processes_mentioning(text: str) -> list[int]:
    """Host pids whose command line contains ``text`` (a sandbox's working directory is in its child's)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                if entry.isdigit() and text.encode() in cmdline.read():
                    found.append(int(entry))
        except OSError:
            continue  # not a process, or it ended while we looked
    return found


def imported(module: str) -> bool:
    """Whether this interpreter has imported ``module`` (called in a child to see what it loaded)."""
    import sys

    return module in sys.modules
