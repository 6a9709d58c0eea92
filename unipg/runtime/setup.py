"""What every run does first, in either mode: seed the generators, set the threads, make its folder and lock it."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import numpy as np
import torch

from unipg.config import Config


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        # cuBLAS is deterministic only with a fixed workspace, set before its first use (CUDA's reproducibility notes)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(1)  # a reduction split across threads may sum in a different order


def run_dir_for(config: Config) -> Path:
    """A fresh folder for the run; an existing run is never appended to or overwritten."""
    root = Path(config.log.output_dir)
    if config.log.run_name:
        run_dir = root / config.log.run_name
        if any((run_dir / name).exists() for name in ("metrics.jsonl", "config.yaml", "checkpoints")):
            raise ValueError(
                f"run directory '{run_dir}' already holds a run; choose another log.run_name or move that run away"
            )
        return run_dir
    subject = config.task.name if config.is_lm else config.env.id
    stem = f"{config.algorithm}-{subject}-seed{config.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir, suffix = root / stem, 1
    while run_dir.exists():
        suffix += 1
        run_dir = root / f"{stem}-{suffix}"
    return run_dir


def set_threads(config: Config) -> None:
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    elif config.model.name.startswith("embedded"):
        torch.set_num_threads(1)


LOCK_FILE = ".lock"
"""The file in a run folder whose lock (``fcntl.flock``) the process writing the run holds."""


def lock_run_dir(run_dir: Path) -> IO[str]:
    """Make ``run_dir`` if needed and lock it for this process: the open lock file, which holds the lock until
    it is closed (or the process ends, even by SIGKILL: the kernel releases it). ``ValueError`` naming the
    process that holds it, if another writer does; nothing in the folder is touched then."""
    import fcntl

    run_dir.mkdir(parents=True, exist_ok=True)
    lock = (run_dir / LOCK_FILE).open("a+", encoding="utf-8")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise ValueError(
            f"run folder {run_dir} is in use by process {holder}; wait until that run ends or stop "
            "it, or train into another folder (log.run_name)"
        ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


@contextmanager
def locked_run_dir(run_dir: Path) -> Iterator[Path]:
    """``run_dir`` locked (``lock_run_dir``) for the ``with`` block. A folder the block made and left empty (it
    failed before writing anything, e.g. on a bad environment id) is removed again."""
    made = not run_dir.exists()
    lock = lock_run_dir(run_dir)
    try:
        yield run_dir
    except BaseException:
        lock.close()
        if made and [path.name for path in run_dir.iterdir()] == [LOCK_FILE]:
            (run_dir / LOCK_FILE).unlink()
            run_dir.rmdir()
        raise
    finally:
        lock.close()


RAY_CONNECT_TIMEOUT = 5.0
"""Seconds to wait for a TCP connection to an explicit ``ray.address`` before the run is refused."""


def check_ray_address(address: str | None) -> None:
    """A ``ValueError`` naming the address and what to do when nothing accepts a TCP connection at the Ray
    cluster ``address`` (``host:port`` or ``ray://host:port``; None reads ``RAY_ADDRESS``, as ``ray.init`` does).
    ``auto`` is looked up as Ray looks it up (the cluster this machine last started or joined) and refused when there
    is none; ``local`` and addresses without a port are left to Ray. Ray itself retries an absent cluster for
    minutes; this fails within ``RAY_CONNECT_TIMEOUT`` seconds, before the run writes anything."""
    import socket

    text = address if address is not None else os.environ.get("RAY_ADDRESS")
    if text == "auto":
        text = _auto_ray_address(address is not None)
    if not text or text in ("auto", "local"):
        return
    host, _, port = text.removeprefix("ray://").rstrip("/").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_CONNECT_TIMEOUT).close()
    except OSError as error:
        reason = "timed out" if isinstance(error, TimeoutError) else (error.strerror or str(error))
        setting = "ray.address" if address is not None else "RAY_ADDRESS"
        raise ValueError(
            f"cannot connect to Ray at {setting}={text!r}: nothing answers there ({reason}); start "
            f"the cluster there (`ray start --head --port {port}`), fix the address, or leave "
            "ray.address unset for a local instance"
        ) from None


def _auto_ray_address(from_config: bool) -> str:
    """The address ``auto`` stands for on this machine; a ``ValueError`` saying what to do when it has none."""
    try:
        from ray._private.services import get_ray_address_from_environment
    except ImportError:  # without Ray the backend says how to install it
        return "auto"
    try:
        return get_ray_address_from_environment("auto", None) or "auto"
    except ConnectionError:
        setting = "ray.address" if from_config else "RAY_ADDRESS"
        raise ValueError(
            f"{setting}=auto joins the Ray cluster this machine belongs to, and none is running here; start one "
            "(`ray start --head`, or `ray start --address=HEAD:6379` to join a head node), give its address "
            "(ray.address=HOST:6379), or leave ray.address unset for a local instance"
        ) from None
