"""Where a run's models live and in what precision: the one reading of the ``device`` setting, for both modes,
and of ``model.dtype``.

``device`` is ``cpu``, ``cuda``, ``cuda:N``, ``mps`` or ``auto`` (CUDA when this machine has it, else the CPU).
A device that is asked for and absent is refused when the configuration loads (``device_problem``), never
replaced by the CPU: a run that asked for a GPU must not train on the CPU and exit 0.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from unipg.config.section import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The parameter dtypes a model may be loaded in (``model.dtype``)."""

STARTUP_THREADS = torch.get_num_threads()
"""torch's intra-op thread count as the process started (one per physical core, or ``OMP_NUM_THREADS``), read
before a run lowers it for the embedded model's small matrix products."""

DEVICE_NAMES = "cpu, cuda, cuda:N (N a GPU index), mps or auto"
_SYNTAX = re.compile(r"cpu|auto|mps|cuda(:\d+)?")


def device_problem(name: str) -> str | None:
    """What is wrong with ``device`` = ``name`` on this machine, phrased as how to fix it; None if nothing."""
    if not _SYNTAX.fullmatch(name):
        return f"device '{name}' is not a device name; use {DEVICE_NAMES}"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            return (
                f"device '{name}': CUDA is not available on this machine (torch {torch.__version__}, "
                f"{'built without CUDA' if torch.version.cuda is None else 'no GPU visible'}); set device=cpu, "
                "or device=auto to use a GPU only where there is one"
            )
        index, count = int(name.partition(":")[2] or 0), torch.cuda.device_count()
        if index >= count:
            return (
                f"device '{name}': this machine has {count} CUDA device{'s' if count != 1 else ''} "
                f"(cuda:0 to cuda:{count - 1}); pick one of them"
            )
    if name == "mps" and not torch.backends.mps.is_available():
        return "device 'mps': Apple's Metal backend is not available on this machine; set device=cpu or device=auto"
    return None


def resolve_device(name: str) -> torch.device:
    """The torch device that ``device`` = ``name`` means on this machine (``auto``: ``cuda`` when CUDA is
    available, else ``cpu``); ``ConfigError`` if it is not a device name or is absent here."""
    problem = device_problem(name)
    if problem is not None:
        raise ConfigError(problem)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (a key of ``DTYPES``); ``ConfigError`` listing them otherwise."""
    if name not in DTYPES:
        raise ConfigError(f"dtype '{name}' is not one of: {', '.join(DTYPES)}")
    return DTYPES[name]


@contextmanager
def cpu_threads(count: int) -> Iterator[None]:
    """Run the block with ``count`` torch intra-op threads, then restore the count it found."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
